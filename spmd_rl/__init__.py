"""spmd_rl: reinforcement learning as one SPMD program on every rank (`python -m spmd_rl.main`).

In Python: `spmd_rl.train(config, overrides)` trains in this process and returns the run (its directory, last
metrics, trained policy); `spmd_rl.load_policy(path)` loads a trained policy; `spmd_rl.evaluate` (the module) has
`evaluate(policy, env_cfg, episodes, ...)`. The extension API (Policy, Algorithm, ...) is `spmd_rl.api`.

Importing this package is cheap: each name is imported on first use (torch, tensordict and the envs take seconds).
"""

from __future__ import annotations

from typing import Any

from spmd_rl.runtime.lazy_names import import_lazily

_LAZY = {
    "train": "spmd_rl.main",
    "TrainedRun": "spmd_rl.main",
    "load_policy": "spmd_rl.run.policies",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    return import_lazily(globals(), _LAZY, __name__, name)
