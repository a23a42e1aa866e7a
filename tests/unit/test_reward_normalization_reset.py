"""env.normalize_reward_reset: where the running discounted return that scales rewards restarts. done (SB3's
VecNormalize): after every episode end, the time limit's truncation too; terminated (the default, gymnasium's
NormalizeReward): a truncated episode's return carries into the next."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest

from spmd_rl.config.loading import load_config
from spmd_rl.envs.backend import finish_vector_env

LIMIT = 5  # CartPole's pole stays up this long whatever the actions: every episode ends by truncation


def running_returns(reset: str) -> list[float]:
    """The wrapper's accumulated return after each of 2 * LIMIT + 2 steps of one env (a reset step between)."""
    overrides = ["env.normalize_reward=true", "env.normalize_reward_gamma=0.5", f"env.normalize_reward_reset={reset}"]
    envs = gym.make_vec("CartPole-v1", num_envs=1, vectorization_mode="sync", max_episode_steps=LIMIT)
    envs, _ = finish_vector_env(envs, load_config(None, overrides).env, seed=0, reset_seed=0)
    returns = []
    for _ in range(2 * LIMIT + 2):
        _, _, terminated, _, _ = envs.step(np.array([0]) if len(returns) % 2 else np.array([1]))
        assert not terminated.any()
        returns.append(float(envs.accumulated_reward[0]))
    return returns


@pytest.mark.parametrize("reset", ["terminated", "done"])
def test_the_running_return_restarts_after_a_truncation_only_with_done(reset):
    returns = running_returns(reset)
    discounted = [sum(0.5**k for k in range(n)) for n in range(1, LIMIT + 1)]  # 1, 1.5, 1.75, ...
    if reset == "done":
        # restarted after the truncating step; the reset step (index LIMIT) adds nothing; then 1, 1.5, ...
        assert returns[: LIMIT - 1] == discounted[:-1] and returns[LIMIT - 1] == 0 == returns[LIMIT]
        assert returns[LIMIT + 1 : 2 * LIMIT] == discounted[:-1]
    else:
        assert returns[:LIMIT] == discounted and returns[LIMIT] == discounted[-1]
        assert returns[LIMIT + 1] == discounted[-1] * 0.5 + 1  # carried over the episode end
