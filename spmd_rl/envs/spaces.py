"""Gymnasium spaces as fixed tensor layouts: what one env's observation looks like on the wire, in a segment and
in an HDF5 file, kept in the env's own dtype and shape (uint8 frames stay uint8; Dict spaces become nested keys; a
Text space arrives as envs/text.py's TokenizedText, a Dict of token ids and their mask)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import gymnasium as gym
import numpy as np
import torch
from tensordict import TensorDict

from spmd_rl.runtime.errors import UserCodeError, UserError

if TYPE_CHECKING:  # annotations only: the type of a TensorDict's values (tensordict 0.10 on)
    from tensordict import TensorCollection


def torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.zeros((), dtype=dtype)).dtype


def zeros_of(space: gym.Space, *batch: int) -> torch.Tensor | TensorDict:
    """Zeros laid out like a batch of the space's samples: a tensor [*batch, *shape], or a TensorDict for Dict."""
    if isinstance(space, gym.spaces.Dict):
        return TensorDict({key: zeros_of(sub, *batch) for key, sub in space.spaces.items()}, batch_size=list(batch))
    if isinstance(space, (gym.spaces.Box, gym.spaces.Discrete, gym.spaces.MultiDiscrete, gym.spaces.MultiBinary)):
        dtype = torch.int64 if isinstance(space, gym.spaces.Discrete) else torch_dtype(space.dtype)
        return torch.zeros(*batch, *(space.shape or ()), dtype=dtype)  # never None here (typed Optional on gym.Space)
    raise UserError(
        f"observation space {space} ({type(space).__name__}) cannot be laid out as tensors; spaces "
        f"supported: Box, Discrete, MultiDiscrete, MultiBinary, Text (as token ids, envs/text.py) and Dict of those"
    )


def numpy_views(tensors: torch.Tensor | TensorCollection):
    """numpy views of a (CPU) tensor or a TensorDict's leaves (nested dicts), for cheap per-step writes."""
    if isinstance(tensors, torch.Tensor):
        return tensors.numpy()
    return {key: numpy_views(value) for key, value in tensors.items()}


def write(views, values, index: int | None = None) -> None:
    """Copy an env's observation batch (an array, or a dict of arrays for Dict spaces) into numpy views, or into
    row `index` of them."""
    if isinstance(views, dict):
        for key, view in views.items():
            write(view, values[key], index)
    elif index is None:
        views[...] = values
    else:
        views[index] = values


def all_finite(values) -> bool:
    if isinstance(values, dict):
        return all(all_finite(value) for value in values.values())
    array = np.asarray(values)
    return not np.issubdtype(array.dtype, np.floating) or bool(np.isfinite(array).all())


def check_finite(who: str, env_id: str, obs, reward, when: str) -> None:
    """NaN or inf from an env would be acted and trained on silently: a UserCodeError naming who stepped it (a rank,
    an evaluation), the env, the step and the env indices. One vectorized check over the whole batch (cheap next to
    env.step); reward None: a reset's observations alone."""
    for what, values in (("reward", reward), ("observation", obs)):
        if values is None or all_finite(values):
            continue
        raise UserCodeError(
            f"{who}: env '{env_id}' returned a non-finite {what} (NaN or inf) at {when} in env index(es) "
            f"{non_finite_envs(values)}; fix the env or wrap it (e.g. clip or check its outputs)"
        )


def non_finite_envs(values) -> list[int]:
    """The env indices (first dimension) whose values hold NaN or inf."""
    if isinstance(values, dict):
        return sorted({i for value in values.values() for i in non_finite_envs(value)})
    array = np.asarray(values)
    if not np.issubdtype(array.dtype, np.floating):
        return []
    return np.flatnonzero(~np.isfinite(array.reshape(array.shape[0], -1)).all(axis=1)).tolist()
