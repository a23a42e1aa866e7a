"""The state of a rank's gymnasium vector env, for checkpoints (the gymnasium backend's capture_state /
restore_state / unsaved_reason): episodes in progress continue after a resume.

Supported (what the gymnasium backend builds for plain-numpy envs):
  - gymnasium's numpy-vectorized CartPole (CartPoleVectorEnv): physics state, step counters, autoreset flags, RNG;
  - SyncVectorEnv of classic-control envs: each env's physics state, TimeLimit's step count, RNG, and the vector
    env's autoreset flags;
  - the wrappers RecordEpisodeStatistics (episodes' returns and lengths so far), NormalizeReward (running return
    statistics), ClipAction (no state); and the action space's RNG (random warm-up actions).
Anything else (AsyncVectorEnv, MuJoCo, Atari, a user's env or wrapper) cannot be saved: unsaved_env_reason
says why, so the run can say at start that a resume begins fresh episodes.

restore_env_state expects an env built by the same config and reset, as make_vector_env returns it.
The encoded state holds only tensors, numbers, strings, None, lists and dicts (loadable with weights_only=True).
"""

from __future__ import annotations

import time
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from gymnasium.envs.classic_control.cartpole import CartPoleVectorEnv
from gymnasium.wrappers import common as single_wrappers
from gymnasium.wrappers import vector as vector_wrappers

from spmd_rl.envs.chunks import ActionChunks
from spmd_rl.runtime.errors import UserError

# Attributes of classic-control envs beyond `state` that a step reads (CartPole's termination warning) or writes.
_CLASSIC_CONTROL_EXTRAS = ("steps_beyond_terminated", "last_u")
# gymnasium's numpy-vectorized CartPole: every array it steps from (its generator is saved beside them)
CARTPOLE_VECTOR_FIELDS = ("state", "steps", "prev_done", "steps_beyond_terminated", "low", "high")


class _Unsaved(Exception):
    """This env (or a wrapper of it) has no known way to save its state."""


def capture_env_state(envs: gym.vector.VectorEnv) -> dict | None:
    """The vector env's state, or None when it cannot be saved (unsaved_env_reason says why)."""
    try:
        return {
            "layers": [_capture_layer(layer) for layer in _vector_layers(envs)],
            "action_space_rng": _encode_rng(envs.action_space.np_random),
        }
    except _Unsaved:
        return None


def unsaved_env_reason(envs: gym.vector.VectorEnv) -> str | None:
    """One line saying why capture_env_state cannot save this env; None when it can."""
    try:
        for layer in _vector_layers(envs):
            _capture_layer(layer)
    except _Unsaved as exc:
        return f"the env's state cannot be saved in checkpoints ({exc}): a resume begins fresh episodes"
    return None


def restore_env_state(envs: gym.vector.VectorEnv, state: dict) -> None:
    """Put a state from capture_env_state into `envs` (built from the same config, and reset)."""
    layers = _vector_layers(envs)
    kinds = [type(layer).__name__ for layer in layers]
    saved = [layer["kind"] for layer in state["layers"]]
    if kinds != saved:
        raise UserError(
            f"the checkpoint's env is {' > '.join(saved)} but this run builds {' > '.join(kinds)}: "
            f"resume with the env config that wrote the checkpoint"
        )
    for layer, layer_state in zip(layers, state["layers"]):
        _restore_layer(layer, layer_state)
    _restore_rng(envs.action_space.np_random, state["action_space_rng"])


def _vector_layers(envs: gym.vector.VectorEnv) -> list:
    layers = [envs]
    while isinstance(layers[-1], gym.vector.VectorWrapper):
        layers.append(layers[-1].env)
    return layers


def _capture_layer(layer) -> dict:
    state: dict[str, Any] = {"kind": type(layer).__name__}
    if isinstance(layer, vector_wrappers.RecordEpisodeStatistics):
        now = time.perf_counter()
        state.update(
            episode_count=_encode(layer.episode_count),
            episode_returns=_encode(layer.episode_returns),
            episode_lengths=_encode(layer.episode_lengths),
            prev_dones=_encode(layer.prev_dones),
            # wall-clock ages, not perf_counter stamps (which mean nothing in another process)
            episode_ages_s=_encode(now - layer.episode_start_times),
            time_queue=_encode(list(layer.time_queue)),
            return_queue=_encode(list(layer.return_queue)),
            length_queue=_encode(list(layer.length_queue)),
        )
    elif isinstance(layer, vector_wrappers.NormalizeReward):
        rms = layer.return_rms
        state.update(
            mean=_encode(rms.mean),
            var=_encode(rms.var),
            count=_encode(rms.count),
            accumulated_reward=_encode(layer.accumulated_reward),
            prev_dones=_encode(layer._prev_dones),
            update_running_mean=_encode(layer.update_running_mean),
        )
    elif isinstance(layer, (vector_wrappers.ClipAction, vector_wrappers.ClipReward)):
        pass  # clips each action or reward; holds nothing between steps
    elif type(layer) is CartPoleVectorEnv:
        state.update({name: _encode(getattr(layer, name)) for name in CARTPOLE_VECTOR_FIELDS})
        state["rng"] = _encode_rng(layer.np_random)
    elif type(layer) is gym.vector.SyncVectorEnv:
        state.update(autoreset_envs=_encode(layer._autoreset_envs), envs=[_capture_single(env) for env in layer.envs])
    else:
        raise _Unsaved(f"{type(layer).__name__} is not a vector env or wrapper whose state is known")
    return state


def _restore_layer(layer, state: dict) -> None:
    if isinstance(layer, vector_wrappers.RecordEpisodeStatistics):
        layer.episode_count = _decode(state["episode_count"])
        layer.episode_returns = _decode(state["episode_returns"])
        layer.episode_lengths = _decode(state["episode_lengths"])
        layer.prev_dones = _decode(state["prev_dones"])
        layer.episode_start_times = time.perf_counter() - _decode(state["episode_ages_s"])
        for queue, values in (
            (layer.time_queue, state["time_queue"]),
            (layer.return_queue, state["return_queue"]),
            (layer.length_queue, state["length_queue"]),
        ):
            queue.clear()
            queue.extend(_decode(values))
    elif isinstance(layer, vector_wrappers.NormalizeReward):
        rms = layer.return_rms
        rms.mean, rms.var, rms.count = _decode(state["mean"]), _decode(state["var"]), _decode(state["count"])
        layer.accumulated_reward = _decode(state["accumulated_reward"])
        layer._prev_dones = _decode(state["prev_dones"])
        layer.update_running_mean = _decode(state["update_running_mean"])
    elif type(layer) is CartPoleVectorEnv:
        for name in CARTPOLE_VECTOR_FIELDS:
            setattr(layer, name, _decode(state[name]))
        _restore_rng(layer.np_random, state["rng"])
    elif type(layer) is gym.vector.SyncVectorEnv:
        if len(state["envs"]) != layer.num_envs:
            raise UserError(
                f"the checkpoint holds {len(state['envs'])} envs on this rank, this run builds "
                f"{layer.num_envs}: resume with the env.num_envs that wrote it"
            )
        layer._autoreset_envs = _decode(state["autoreset_envs"])
        for env, env_state in zip(layer.envs, state["envs"]):
            _restore_single(env, env_state)


def _capture_single(env: gym.Env) -> dict:
    """One env of a SyncVectorEnv: its wrappers (only the stateless checkers, ActionChunks or TimeLimit) and a
    classic-control env underneath."""
    state = {}
    while isinstance(env, gym.Wrapper):
        if isinstance(env, single_wrappers.TimeLimit):
            state["elapsed_steps"] = _encode(env._elapsed_steps)
        elif not isinstance(env, (single_wrappers.OrderEnforcing, single_wrappers.PassiveEnvChecker, ActionChunks)):
            raise _Unsaved(f"wrapper {type(env).__name__} is not one whose state is known")
        env = env.env
    if not type(env).__module__.startswith("gymnasium.envs.classic_control."):
        raise _Unsaved(f"{type(env).__name__} is not a classic-control env")
    classic: Any = env  # a classic-control env: `state` is its physics (gym.Env declares no such attribute)
    state["state"] = _encode(classic.state)
    state["extras"] = {name: _encode(getattr(env, name)) for name in _CLASSIC_CONTROL_EXTRAS if hasattr(env, name)}
    state["rng"] = _encode_rng(env.np_random)
    return state


def _restore_single(env: gym.Env, state: dict) -> None:
    while isinstance(env, gym.Wrapper):
        if isinstance(env, single_wrappers.TimeLimit):
            env._elapsed_steps = _decode(state["elapsed_steps"])
        env = env.env
    classic: Any = env  # a classic-control env (captured above): `state` is its physics
    classic.state = _decode(state["state"])
    for name, value in state["extras"].items():
        setattr(env, name, _decode(value))
    _restore_rng(env.np_random, state["rng"])


def _encode_rng(generator: np.random.Generator):
    return _encode(generator.bit_generator.state)


def _restore_rng(generator: np.random.Generator, state) -> None:
    # Set in place: the env, its spaces and its wrappers may share this generator object.
    generator.bit_generator.state = _decode(state)


def _encode(value):
    """numpy arrays and scalars -> tensors (dtype kept), tuples -> lists; everything else as it is."""
    if isinstance(value, (np.ndarray, np.generic)):
        return torch.from_numpy(np.array(value))  # a copy: later steps must not change a captured state
    if isinstance(value, (list, tuple)):
        return [_encode(v) for v in value]
    if isinstance(value, dict):
        return {k: _encode(v) for k, v in value.items()}
    return value


def _decode(value):
    """Tensors -> numpy (0-d ones -> numpy scalars); containers decoded item by item."""
    if isinstance(value, torch.Tensor):
        array = value.numpy().copy()
        return array[()] if array.ndim == 0 else array
    if isinstance(value, list):
        return [_decode(v) for v in value]
    if isinstance(value, dict):
        return {k: _decode(v) for k, v in value.items()}
    return value


def as_tensors(value):
    """numpy arrays (and dicts of them, Dict observations) as tensors, for weights_only checkpoints."""
    if isinstance(value, dict):
        return {key: as_tensors(item) for key, item in value.items()}
    return torch.from_numpy(np.array(value, copy=True))


def as_arrays(value):
    if isinstance(value, dict):
        return {key: as_arrays(item) for key, item in value.items()}
    return value.numpy()
