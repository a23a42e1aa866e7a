"""What the warm interpreter (rank_server.py) imports before it forks processes, in spmd_rl/main.py's order; also
imported by process_probe.py, so that a probe started fresh has imported what a forked one has. Standard library
and the project's own dependencies only."""

from __future__ import annotations

import importlib


def warm_up() -> None:
    """What every rank imports before its run (spmd_rl/main.py's order) and what every rank that builds the policy
    imports in its checks before start, and nothing more: FSDP's modules stay for the ranks that use them. Not
    spmd_rl.main itself: runpy runs it as __main__."""
    from spmd_rl.runtime.exits import quiet_torch_cpp_warnings

    quiet_torch_cpp_warnings()  # as spmd_rl.main does before torch loads: torch reads it once, as it loads
    import torch  # noqa: F401

    from spmd_rl.config import loading  # noqa: F401
    from spmd_rl.runtime.fast_imports import import_tensordict_without_dynamo, optimizers_without_dynamo

    import_tensordict_without_dynamo()
    optimizers_without_dynamo()
    import gymnasium.envs.classic_control  # noqa: F401

    import spmd_rl.run.driver  # noqa: F401

    # Those ranks check the policy as fake tensors (run/contract.py), and FakeTensorMode imports torch._dynamo and
    # sympy: over half of a tiny colocated rank's CPU seconds. Imported after tensordict and the optimizers' patch,
    # as those ranks import it; an env rank, which skips the check, gets it too and uses nothing of it.
    for name in ("torch._subclasses.fake_tensor", "torch._dynamo"):
        importlib.import_module(name)
