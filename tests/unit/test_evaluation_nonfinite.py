"""An evaluation's env that returns NaN is named, as the env ranks name it in training: the policy acted on it and the
evaluation reported a return as if nothing were wrong (fault pass 9, N1: eval 10.00 from NaN observations)."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.envs.classic_control.pendulum import PendulumEnv

from spmd_rl.config import plugins
from spmd_rl.config.loading import load_config
from spmd_rl.envs.vector import probe_env
from spmd_rl.run.evaluation import evaluate
from spmd_rl.run.policies import build_policy
from spmd_rl.runtime.errors import UserCodeError


class NaNAtStep3(PendulumEnv):
    def __init__(self, what: str = "observation", **kwargs):
        super().__init__(**kwargs)
        self.what, self.steps = what, 0

    def reset(self, *, seed=None, options=None):
        self.steps = 0
        return super().reset(seed=seed, options=options)

    def step(self, action):
        obs, reward, terminated, truncated, info = super().step(action)
        self.steps += 1
        if self.steps == 3:
            if self.what == "observation":
                obs = np.full_like(obs, np.nan)
            else:
                reward = float("inf")
        return obs, reward, terminated, truncated, info


gym.register(id="SpmdRlTestNaNAtStep3-v0", entry_point=NaNAtStep3, max_episode_steps=20)


@pytest.mark.parametrize("what", ["observation", "reward"])
def test_a_non_finite_value_in_an_evaluation_is_a_user_code_error_naming_the_env_and_step(what):
    cfg = load_config(None, ["env.id=SpmdRlTestNaNAtStep3-v0", "env.num_envs=2", f"env.kwargs={{what: {what}}}"])
    spec = probe_env(cfg.env)
    policy = build_policy(cfg, spec, plugins.load_class(plugins.POLICY, cfg.classes["policy"]))
    with pytest.raises(UserCodeError, match=rf"returned a non-finite {what} \(NaN or inf\) at evaluation step 3"):
        evaluate(policy, cfg.env, episodes=2, seed=0, deterministic=True)
