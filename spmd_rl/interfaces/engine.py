"""The Engine contract: the loops one rank runs for the whole run."""

from __future__ import annotations

from typing import Any, ClassVar

from spmd_rl.config.schema import NoConfig


class Engine:
    """Drives the role loops of one run on this rank. The sync engine (spmd_rl.run.setup.SyncEngine) is the
    built-in; an engine is chosen by `engine.class`."""

    Config: ClassVar[type] = NoConfig

    def __init__(self, config: Any):
        self.config = config

    def run(self, setup) -> Policy | None:
        """Run this rank's role for the whole run; return the policy (trainer rank 0's is saved)."""
        raise NotImplementedError
