"""A stand-in for a slow simulator: CartPole whose every step sleeps 5 ms. Used as
env.id=benchmarks.slow_env:SlowCartPole-v1 (gymnasium imports this module, which registers the id)."""

import time

import gymnasium as gym
from gymnasium.envs.classic_control.cartpole import CartPoleEnv


class SlowCartPole(CartPoleEnv):
    def __init__(self, step_sleep_s: float = 0.005, **kwargs):
        super().__init__(**kwargs)
        self.step_sleep_s = step_sleep_s

    def step(self, action):
        time.sleep(self.step_sleep_s)
        return super().step(action)


gym.register("SlowCartPole-v1", entry_point=SlowCartPole, max_episode_steps=500)
