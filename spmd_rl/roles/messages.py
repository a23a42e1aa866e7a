"""The fixed layouts of every message between roles, computed from the env spec and the config alone.

Every rank can build every layout without talking to anyone, which is what lets channels preallocate their
buffers once and check each message against the agreed layout.
"""

from __future__ import annotations

import gymnasium as gym
import torch
from tensordict import TensorDict

from spmd_rl.envs import EnvSpec


def action_shape_dtype(spec: EnvSpec) -> tuple[tuple[int, ...], torch.dtype]:
    if isinstance(spec.action_space, gym.spaces.Discrete):
        return (), torch.int64
    return tuple(spec.action_space.shape), torch.float32


def observation_message(spec: EnvSpec, num_envs: int) -> TensorDict:
    """env worker -> inference server, every step."""
    return TensorDict({"obs": torch.zeros(num_envs, *spec.observation_space.shape)}, batch_size=[])


def action_message(spec: EnvSpec, num_envs: int) -> TensorDict:
    """inference server -> env worker, every step. The policy version lets the env prove it acted on fresh weights;
    inference_s (seconds in the forward pass) lets the trainer tell inference time from transfer time."""
    shape, dtype = action_shape_dtype(spec)
    return TensorDict({
        "action": torch.zeros(num_envs, *shape, dtype=dtype),
        "log_prob": torch.zeros(num_envs),
        "value": torch.zeros(num_envs),
        "policy_version": torch.zeros(1, dtype=torch.int64),
        "inference_s": torch.zeros(1, dtype=torch.float64),
    }, batch_size=[])


def segment_message(spec: EnvSpec, num_steps: int, num_envs: int) -> TensorDict:
    """env worker -> trainer, once per rollout: the rollout [T, N], the observation after it, and the env side's
    episode statistics and timings."""
    shape, dtype = action_shape_dtype(spec)
    t, n = num_steps, num_envs
    rollout = TensorDict({
        "obs": torch.zeros(t, n, *spec.observation_space.shape),
        "action": torch.zeros(t, n, *shape, dtype=dtype),
        "log_prob": torch.zeros(t, n),
        "value": torch.zeros(t, n),
        "reward": torch.zeros(t, n),
        "terminated": torch.zeros(t, n, dtype=torch.bool),
        "truncated": torch.zeros(t, n, dtype=torch.bool),
        "valid": torch.zeros(t, n, dtype=torch.bool),          # False on autoreset steps (action ignored)
        "episode_return": torch.zeros(t, n),                   # set where an episode ended
        "episode_length": torch.zeros(t, n, dtype=torch.int64),
        "episode_done": torch.zeros(t, n, dtype=torch.bool),
    }, batch_size=[t, n])
    return TensorDict({
        "rollout": rollout,
        "next_obs": torch.zeros(n, *spec.observation_space.shape),
        "policy_version": torch.zeros(t, dtype=torch.int64),   # the version each step's actions came from
        "env_s": torch.zeros(1, dtype=torch.float64),          # seconds in env.step this rollout
        "action_wait_s": torch.zeros(1, dtype=torch.float64),  # seconds from sending obs to having actions
        "inference_s": torch.zeros(1, dtype=torch.float64),    # of which the inference server computed
    }, batch_size=[])
