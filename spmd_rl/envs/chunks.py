"""Action chunks (`env.action_chunk: K`): one policy decision is K actions, executed as up to K primitive steps.

Each single env is wrapped (ActionChunks) so that one step of the vector env is one decision: the env runs the
chunk's actions in order and stops early at the step that terminates or truncates its episode. The vector env's
NEXT_STEP autoreset therefore acts between decisions, as it does between steps without chunks: an episode that
ends mid-chunk never runs the rest of the chunk into the next episode; that env's next decision is its reset step.
The wrapper's reward is the chunk's undiscounted sum (what episode statistics add up); the K rewards and how many
steps ran travel in `info`, from which the env runner records them (discounting is the algorithm's business). The
info is the last step's, and for an env that reports a success flag (EnvSpec.success_key) also whether the flag was
set at any step that ran (CHUNK_SUCCESS): an episode that succeeds mid-chunk succeeded (envs/success.py).
"""

from __future__ import annotations

import dataclasses
from typing import cast

import gymnasium as gym
import numpy as np

from spmd_rl.config.sections import EnvSection
from spmd_rl.envs.backend import EnvSpec
from spmd_rl.runtime.errors import UserError

# The info keys of a chunk's K primitive rewards (float32 [K], 0 after an early stop), its executed steps, and
# whether the env's success flag was set at any of them (only for an env that reports one).
CHUNK_REWARDS = "chunk_rewards"
CHUNK_STEPS = "chunk_steps"
CHUNK_SUCCESS = "chunk_success"


def chunk_space(space: gym.spaces.Box, chunk: int) -> gym.spaces.Box:
    """The action space of a chunk of `chunk` actions of `space` (a Box): Box [chunk, *shape], the bounds repeated."""
    low = np.broadcast_to(space.low, (chunk, *space.shape))
    high = np.broadcast_to(space.high, (chunk, *space.shape))
    return gym.spaces.Box(low, high, dtype=space.dtype)


def chunked_spec(spec: EnvSpec, cfg: EnvSection) -> EnvSpec:
    """The spec the policy and the vector env see with env.action_chunk K > 1 (the spec as it is for K = 1).
    Envs are wrapped one by one, so an env's own vectorized implementation gives way to sync vectorization."""
    chunk = cfg.action_chunk
    if chunk == 1:
        return spec
    if not isinstance(spec.action_space, gym.spaces.Box):
        raise UserError(
            f"env.action_chunk={chunk} needs a Box action space; env '{spec.id}' has {spec.action_space}; set "
            f"env.action_chunk=1"
        )
    if cfg.normalize_reward or cfg.clip_reward:
        raise UserError(
            f"env.action_chunk={chunk} with env.normalize_reward or env.clip_reward is not supported (they would "
            f"scale each chunk's sum, not its K rewards); set them off or env.action_chunk=1"
        )
    if cfg.vectorization == "vector_entry_point":
        raise UserError(
            f"env.action_chunk={chunk} wraps each env to run its chunks: use env.vectorization=auto, sync or async, "
            f"not vector_entry_point"
        )
    vectorization = spec.vectorization if spec.vectorization in ("sync", "async") else "sync"
    return dataclasses.replace(
        spec, action_space=chunk_space(spec.action_space, chunk), vectorization=vectorization, action_chunk=chunk
    )


def executed_steps(info: dict, num_envs: int) -> np.ndarray:
    """The primitive steps each env of a vector env ran in its last step (its chunk's CHUNK_STEPS), int64 [num_envs]:
    0 for an env that only reset (its info holds no chunk)."""
    if CHUNK_STEPS not in info:
        return np.zeros(num_envs, dtype=np.int64)
    return np.where(info["_" + CHUNK_STEPS], info[CHUNK_STEPS], 0)


class ActionChunks(gym.Wrapper):
    """Steps the wrapped env with each action of a chunk [K, *shape] in turn, up to the step that ends its episode.

    Returns the last step's observation, termination, truncation and info, the chunk's reward sum as the reward,
    and in info the K rewards (CHUNK_REWARDS, zero past an early stop), the steps executed (CHUNK_STEPS) and, with
    success_key, whether any executed step's info set that flag (CHUNK_SUCCESS)."""

    def __init__(self, env: gym.Env, chunk: int, success_key: str | None = None):
        super().__init__(env)
        self.chunk = chunk
        self.success_key = success_key
        self.action_space = chunk_space(cast(gym.spaces.Box, env.action_space), chunk)  # chunked_spec checked

    def step(self, action):
        rewards = np.zeros(self.chunk, dtype=np.float32)
        succeeded = False
        for k in range(self.chunk):
            obs, reward, terminated, truncated, info = self.env.step(action[k])
            rewards[k] = reward
            if self.success_key is not None:
                succeeded = succeeded or bool(info.get(self.success_key, False))
            if terminated or truncated:
                break
        info = {**info, CHUNK_REWARDS: rewards, CHUNK_STEPS: np.int64(k + 1)}
        if self.success_key is not None:
            info[CHUNK_SUCCESS] = succeeded
        return obs, float(rewards.sum(dtype=np.float64)), terminated, truncated, info
