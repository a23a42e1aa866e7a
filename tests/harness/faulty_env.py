"""Envs and an algorithm that fail on purpose, for the fault-injection suite (tests/launchers/test_faults.py).

    env.id=tests.harness.faulty_env:Faulty-v0  env.kwargs={fault: raise, rank: 1, after: 40}

Faulty-v0 is CartPole, except that in the process whose launcher rank (RANK) is `rank`, after `after` steps of
one env, step() raises (fault: raise), returns a NaN observation (fault: nan_obs) or reward (fault: nan_reward), kills
its own process with SIGKILL (fault: kill; an async env worker dying as the out-of-memory killer ends it) or calls
os._exit(7) (fault: os_exit).
rank -1 arms it where RANK is unset: one process and its env worker processes.
Every other rank, and the probe that main runs before any process group exists, sees plain CartPole.

    algo.class=tests.harness.faulty_env:PoisonedPPO  algo.poison_iteration=2

PoisonedPPO is PPO, except that at one iteration a NaN reaches its rollout on the trainer side (after the env's
check), so the loss, the gradients, Adam's moments and the weights all turn NaN: what a numerically broken update
does to a run.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

import gymnasium as gym
import numpy as np
from gymnasium.envs.classic_control.cartpole import CartPoleEnv

from spmd_rl.algorithms.configs import PPOConfig
from spmd_rl.algorithms.ppo import PPO
from spmd_rl.config.sections import knob


class FaultyCartPole(CartPoleEnv):
    def __init__(self, fault: str = "raise", rank: int = 1, after: int = 40, **kwargs):
        super().__init__(**kwargs)
        self.fault = fault
        self.armed = int(os.environ.get("RANK", "-1")) == rank
        self.after = after
        self.steps_taken = 0

    def step(self, action):
        self.steps_taken += 1
        obs, reward, terminated, truncated, info = super().step(action)
        if self.armed and self.steps_taken > self.after:
            if self.fault == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if self.fault == "os_exit":
                os._exit(7)
            if self.fault == "raise":
                raise ValueError(f"Faulty-v0: deliberate failure after {self.after} steps")
            if self.fault == "nan_obs":
                obs = np.full_like(obs, np.nan)
            elif self.fault == "nan_reward":
                reward = float("nan")
        return obs, reward, terminated, truncated, info


gym.register(id="Faulty-v0", entry_point=FaultyCartPole, max_episode_steps=500)


@dataclass
class PoisonedPPOConfig(PPOConfig):
    poison_iteration: int = knob(2, "the iteration whose rollout gets a NaN reward on the trainer", min=0)


class PoisonedPPO(PPO):
    Config = PoisonedPPOConfig

    def learn(self, segment, iteration: int) -> dict[str, float]:
        if iteration == self.config.poison_iteration:
            segment["rollout"]["reward"][0, 0] = float("nan")
        return super().learn(segment, iteration)
