"""An env whose step stops answering, for a stalled pipeline stage (tests/runs/test_pipeline_runs.py).

    env.id=tests.harness.stalling_env:StallingCartPole-v0  train.seed=0

StallingCartPole-v0 is CartPole, except that after 5 steps its step sleeps for 10 minutes in the envs whose first
reset took an odd seed: with train.seed=0 and an env rank's two envs in two stages (env.pipeline_stages=2), the
envs of stage 1. The probe resets with seed 0, so it never stalls.
"""

from __future__ import annotations

import time

import gymnasium as gym


class StallingCartPole(gym.Wrapper):
    def __init__(self):
        super().__init__(gym.make("CartPole-v1"))
        self.steps = 0
        self.stalls = False

    def reset(self, *, seed=None, options=None):
        if seed is not None:
            self.stalls = seed % 2 == 1
        return self.env.reset(seed=seed, options=options)

    def step(self, action):
        self.steps += 1
        if self.stalls and self.steps > 5:
            time.sleep(600)  # a simulator that stopped answering
        return self.env.step(action)


gym.register("StallingCartPole-v0", entry_point=StallingCartPole)
