"""Names a module exports without importing them until first use (a module-level `__getattr__`): the package's and
spmd_rl.api's, whose imports pull in torch, tensordict and the envs (seconds), and the async engine's."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any


def import_lazily(namespace: dict[str, Any], table: Mapping[str, str], owner: str, name: str) -> Any:
    """`name` from the module table names for it, kept in namespace (the owner module's globals) so that the next
    use finds it directly; an AttributeError, worded as Python's, for a name the table lacks."""
    module = table.get(name)
    if module is None:
        raise AttributeError(f"module '{owner}' has no attribute '{name}'")
    value = getattr(importlib.import_module(module), name)
    namespace[name] = value
    return value
