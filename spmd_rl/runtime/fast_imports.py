"""Imports that would otherwise cost every rank a second at start-up.

tensordict marks a few of torch's functorch functions with `torch.compiler.allow_in_graph` when it is imported, and
that call imports torch._dynamo (about 1.2 s of a 2.8 s start on a 2-core machine, measured by
benchmarks/startup.py). The marks only matter inside `torch.compile`, which spmd_rl does not use (it was measured
slower for these policies: benchmarks/README.md). So a run imports tensordict with those two decorators as the
identity, for the length of that import only. A user who compiles their own code that calls tensordict's vmap gets
a graph break there instead of a traced call; their results are unchanged.

torch.optim.Optimizer's add_param_group, zero_grad, state_dict and load_state_dict are wrapped by
torch._disable_dynamo, which imports torch._dynamo at their first call (1.6 of a one-iteration run's CPU seconds:
every trainer builds an optimizer). The wrapper keeps dynamo from tracing them inside `torch.compile`, and caches
what it would call on the function as `__dynamo_disable`; setting that cache to the function itself makes the
wrapper call it directly, without the import. Only code that calls these four methods inside torch.compile sees a
difference (it traces them instead of breaking the graph); the optimizer's numbers are the same.
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


def optimizers_without_dynamo() -> None:
    """Make torch.optim.Optimizer's torch._disable_dynamo-wrapped methods call their function without importing
    torch._dynamo (see the module's docstring). A method torch does not wrap that way (other versions) is left as
    it is."""
    from torch.optim import Optimizer

    for method in vars(Optimizer).values():
        code = getattr(method, "__code__", None)
        wrapped = getattr(method, "__wrapped__", None)
        if code is None or wrapped is None or not code.co_filename.endswith("_compile.py") or code.co_name != "inner":
            continue
        if getattr(wrapped, "__dynamo_disable", None) is None:  # not yet called (nor cached) with dynamo
            setattr(wrapped, "__dynamo_disable", wrapped)


def _unchanged(fn):
    return fn
