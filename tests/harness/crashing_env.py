"""A user environment that crashes on one rank: the failing-rank tests of every launcher use it.

    env.id=tests.harness.crashing_env:Crashing-v0     (the repository root on PYTHONPATH or as the working directory)

CartPole, except that step() raises after CRASH_AFTER_STEPS steps in the process whose launcher rank is
CRASH_RANK, so the job is mid-run, with every rank waiting on the others, when one of them dies.
"""

from __future__ import annotations

import os

import gymnasium as gym
from gymnasium.envs.classic_control.cartpole import CartPoleEnv

CRASH_RANK = 1
CRASH_AFTER_STEPS = 20
# The launcher's rank variables in spmd_rl.runtime.launch's precedence: torchrun, MPI, then srun.
RANK_VARIABLES = ("RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID")


def launcher_rank() -> int:
    for name in RANK_VARIABLES:
        if name in os.environ:
            return int(os.environ[name])
    return 0


class CrashingCartPole(CartPoleEnv):
    """CartPole whose step() raises on rank CRASH_RANK after CRASH_AFTER_STEPS steps."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.crashes = launcher_rank() == CRASH_RANK
        self.steps_taken = 0

    def step(self, action):
        self.steps_taken += 1
        if self.crashes and self.steps_taken > CRASH_AFTER_STEPS:
            raise RuntimeError(
                f"Crashing-v0: deliberate failure on rank {CRASH_RANK} after {CRASH_AFTER_STEPS} "
                f"steps (tests/harness/crashing_env.py)"
            )
        return super().step(action)


gym.register(id="Crashing-v0", entry_point=CrashingCartPole, max_episode_steps=500)
