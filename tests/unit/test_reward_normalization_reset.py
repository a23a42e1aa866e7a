"""env.normalize_reward_reset: where the running discounted return that scales rewards restarts. done (SB3's
VecNormalize): after every episode end, the time limit's truncation too; terminated (the default, gymnasium's
NormalizeReward): a truncated episode's return carries into the next."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest

from spmd_rl.config.loading import load_config
from spmd_rl.envs.backend import finish_vector_env
from spmd_rl.envs.gymnasium_state import capture_env_state, restore_env_state

LIMIT = 5  # CartPole's pole stays up this long whatever the actions: every episode ends by truncation


def make_envs(reset: str):
    overrides = ["env.normalize_reward=true", "env.normalize_reward_gamma=0.5", f"env.normalize_reward_reset={reset}"]
    envs = gym.make_vec("CartPole-v1", num_envs=1, vectorization_mode="sync", max_episode_steps=LIMIT)
    return finish_vector_env(envs, load_config(None, overrides).env, seed=0, reset_seed=0)[0]


def running_returns(envs, steps: int, start: int = 0) -> tuple[list[float], list[float]]:
    """The wrapper's accumulated return and the scaled reward after each of `steps` steps of one env."""
    returns, rewards = [], []
    for t in range(start, start + steps):
        _, reward, terminated, _, _ = envs.step(np.array([t % 2]))
        assert not terminated.any()
        returns.append(float(envs.accumulated_reward[0]))
        rewards.append(float(reward[0]))
    return returns, rewards


@pytest.mark.parametrize("reset", ["terminated", "done"])
def test_the_running_return_restarts_after_a_truncation_only_with_done(reset):
    returns, _ = running_returns(make_envs(reset), 2 * LIMIT + 2)
    discounted = [sum(0.5**k for k in range(n)) for n in range(1, LIMIT + 1)]  # 1, 1.5, 1.75, ...
    if reset == "done":
        # restarted after the truncating step; the reset step (index LIMIT) adds nothing; then 1, 1.5, ...
        assert returns[: LIMIT - 1] == discounted[:-1] and returns[LIMIT - 1] == 0 == returns[LIMIT]
        assert returns[LIMIT + 1 : 2 * LIMIT] == discounted[:-1]
    else:
        assert returns[:LIMIT] == discounted and returns[LIMIT] == discounted[-1]
        assert returns[LIMIT + 1] == discounted[-1] * 0.5 + 1  # carried over the episode end


def test_done_resumes_from_a_checkpoint_mid_episode():
    envs = make_envs("done")
    whole = running_returns(envs, 2 * LIMIT + 2)
    first = make_envs("done")
    running_returns(first, LIMIT + 2)  # into the second episode
    resumed = make_envs("done")
    restore_env_state(resumed, capture_env_state(first))
    rest = running_returns(resumed, LIMIT, start=LIMIT + 2)
    assert rest == tuple(part[LIMIT + 2 :] for part in whole)
