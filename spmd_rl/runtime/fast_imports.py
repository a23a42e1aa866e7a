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

DistributedDataParallel's constructor reads `torch._dynamo.utils.get_optimize_ddp_mode()` (whether dynamo's
python_reducer is configured, which only a user's torch.compile code can have set), and its forward enters a
torch._disable_dynamo-wrapped context manager: every DDP trainer rank imported torch._dynamo for these, 1.3 CPU
seconds of its start. Until something imports torch._dynamo, its config holds its defaults, so the constructor is
shown dynamo's default answer for the length of the call, and the context manager gets the optimizer's treatment.
A process that has imported torch._dynamo before builds DDP as torch does.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only: this module exists to import them late
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel


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
    torch._dynamo (see the module's docstring)."""
    from torch.optim import Optimizer

    _call_wrapped_directly(Optimizer)


def data_parallel_without_dynamo(module: nn.Module, **options: Any) -> DistributedDataParallel:
    """DistributedDataParallel(module, **options), built and run without importing torch._dynamo (see the module's
    docstring)."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    if "torch._dynamo" in sys.modules:  # a user's code imported it: its config may say otherwise, so ask it
        return DistributedDataParallel(module, **options)
    _call_wrapped_directly(DistributedDataParallel)
    torch._dynamo = _DYNAMO_DEFAULTS  # type: ignore[assignment]  # a stand-in for the module, as said above
    try:
        return DistributedDataParallel(module, **options)
    finally:
        if getattr(torch, "_dynamo", None) is _DYNAMO_DEFAULTS:  # a real import in between replaces it: keep that
            del torch._dynamo


def _call_wrapped_directly(cls) -> None:
    """Cache each torch._disable_dynamo-wrapped method of cls (also under a decorator such as contextmanager) as its
    own function, so the wrapper calls it without importing torch._dynamo. A method torch does not wrap that way
    (other versions) is left as it is."""
    for method in vars(cls).values():
        layer = method
        while (wrapped := getattr(layer, "__wrapped__", None)) is not None:
            code = getattr(layer, "__code__", None)
            is_wrapper = code is not None and code.co_filename.endswith("_compile.py") and code.co_name == "inner"
            if is_wrapper and getattr(wrapped, "__dynamo_disable", None) is None:  # not yet cached with dynamo
                setattr(wrapped, "__dynamo_disable", wrapped)
            layer = wrapped


# What DDP's constructor asks of torch._dynamo, answered from dynamo's default config: optimize_ddp = True, which
# get_optimize_ddp_mode() names "ddp_optimizer" (not the python_reducer the constructor checks for).
_DYNAMO_DEFAULTS = SimpleNamespace(utils=SimpleNamespace(get_optimize_ddp_mode=lambda: "ddp_optimizer"))


def _unchanged(fn):
    return fn
