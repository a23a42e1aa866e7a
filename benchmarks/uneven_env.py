"""Stand-ins for simulators of uneven speed (benchmarks/async.py), CartPole underneath:

    env.id=benchmarks.uneven_env:UnevenCartPole-v1     every step sleeps a random 1-10 ms (uniform)
    env.id=benchmarks.uneven_env:SlowRankCartPole-v1   every step sleeps 5 ms, 20 ms (4x) on the launcher rank
                                                       named by env.kwargs.slow_rank

Each process draws its own sleep times from a generator seeded by its launcher rank.
"""

import os
import random
import time

import gymnasium as gym
from gymnasium.envs.classic_control.cartpole import CartPoleEnv


def launcher_rank() -> int:
    for name in ("RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID"):
        if name in os.environ:
            return int(os.environ[name])
    return 0


LOW_S, HIGH_S = 0.001, 0.010  # UnevenCartPole's step time range (benchmarks/async.py derives its ideal ratio)


class UnevenCartPole(CartPoleEnv):
    def __init__(self, low_s: float = LOW_S, high_s: float = HIGH_S, **kwargs):
        super().__init__(**kwargs)
        self.low_s, self.high_s = low_s, high_s
        self.sleeps = random.Random(1000 + launcher_rank())

    def step(self, action):
        time.sleep(self.sleeps.uniform(self.low_s, self.high_s))
        return super().step(action)


class SlowRankCartPole(CartPoleEnv):
    def __init__(self, slow_rank: int = -1, step_sleep_s: float = 0.005, slowdown: float = 4.0, **kwargs):
        super().__init__(**kwargs)
        self.step_sleep_s = step_sleep_s * (slowdown if launcher_rank() == slow_rank else 1.0)

    def step(self, action):
        time.sleep(self.step_sleep_s)
        return super().step(action)


gym.register("UnevenCartPole-v1", entry_point=UnevenCartPole, max_episode_steps=500)
gym.register("SlowRankCartPole-v1", entry_point=SlowRankCartPole, max_episode_steps=500)
