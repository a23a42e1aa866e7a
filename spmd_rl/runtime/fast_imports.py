"""Imports that would otherwise cost every rank a second at start-up.

tensordict marks a few of torch's functorch functions with `torch.compiler.allow_in_graph` when it is imported, and
that call imports torch._dynamo (about 1.2 s of a 2.8 s start on a 2-core machine, measured by
benchmarks/startup.py). The marks only matter inside `torch.compile`, which spmd_rl does not use (it was measured
slower for these policies: benchmarks/README.md). So a run imports tensordict with those two decorators as the
identity, for the length of that import only. A user who compiles their own code that calls tensordict's vmap gets
a graph break there instead of a traced call; their results are unchanged.
"""

from __future__ import annotations

import sys


def import_tensordict_without_dynamo() -> None:
    """Import tensordict (if nothing has yet) without importing torch._dynamo."""
    if "tensordict" in sys.modules:
        return
    import torch.compiler

    saved = torch.compiler.allow_in_graph, torch.compiler.assume_constant_result
    torch.compiler.allow_in_graph = torch.compiler.assume_constant_result = _unchanged
    try:
        import tensordict  # noqa: F401
    finally:
        torch.compiler.allow_in_graph, torch.compiler.assume_constant_result = saved


def _unchanged(fn):
    return fn
