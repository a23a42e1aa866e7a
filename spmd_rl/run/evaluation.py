"""Episodes with a policy on envs of their own: the evaluation during training (`eval.every`) and after it
(`python -m spmd_rl.evaluate`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import gymnasium as gym
import numpy as np
import torch

from spmd_rl.config.sections import EnvSection
from spmd_rl.envs import spaces
from spmd_rl.envs.vector import make_vector_env, probe_env
from spmd_rl.roles.messages import observation_message
from spmd_rl.runtime.errors import UserError


def evaluate(
    policy, env_cfg: EnvSection, episodes: int, seed: int, deterministic: bool, video_dir: str | Path | None = None
) -> dict:
    """Play `episodes` episodes on envs of its own and return their statistics:
    {episodes, deterministic, seed, return_mean, return_std, length_mean, length_std, returns, lengths}
    (std over episodes, ddof=0; the lists in the order episodes finished).

    Runs min(episodes, env.num_envs) envs (one with video_dir), seeded from `seed`. Each env slot plays a fixed
    quota of episodes, so short episodes finishing first do not crowd out long ones. The caller's random state is
    untouched: torch's generators are forked and seeded from `seed` (a call during training changes nothing there),
    and the policy's train/eval mode is restored."""
    if episodes < 1:
        raise UserError(f"evaluation episodes={episodes}: evaluate at least 1 episode")
    spec = probe_env(env_cfg)
    # Returns are the env's own rewards: reward scaling only matters for learning.
    env_cfg = dataclasses.replace(env_cfg, num_envs=min(episodes, env_cfg.num_envs), normalize_reward=False)
    wrappers = None
    if video_dir is not None:
        require_moviepy()
        from gymnasium.wrappers import RecordVideo

        env_cfg = dataclasses.replace(env_cfg, num_envs=1, kwargs={**env_cfg.kwargs, "render_mode": "rgb_array"})
        spec = dataclasses.replace(spec, vectorization="sync")  # RecordVideo wraps a single env
        wrappers = [lambda env: RecordVideo(env, str(video_dir), episode_trigger=lambda _: True, name_prefix="eval")]
    envs, obs = _make_envs(env_cfg, spec, seed, wrappers)

    device = _device_of(policy)
    was_training = policy.training
    try:
        with torch.random.fork_rng(devices=cuda_indices(device)), torch.no_grad():
            torch.default_generator.manual_seed(seed)
            if device.type == "cuda":
                torch.cuda.default_generators[cuda_indices(device)[0]].manual_seed(seed)
            returns, lengths = _play(
                policy.eval(), spec, envs, obs, _quotas(episodes, envs.num_envs), deterministic, device
            )
    finally:
        policy.train(was_training)
        envs.close()  # also writes the last episode's video
    return {
        "episodes": episodes,
        "deterministic": deterministic,
        "seed": seed,
        "return_mean": float(np.mean(returns)),
        "return_std": float(np.std(returns)),
        "length_mean": float(np.mean(lengths)),
        "length_std": float(np.std(lengths)),
        "returns": returns,
        "lengths": lengths,
    }


def _play(policy, spec, envs, obs, quotas: np.ndarray, deterministic: bool, device: torch.device):
    buffer = observation_message(spec, envs.num_envs)["obs"]  # the layout the inference server acts on
    views = spaces.numpy_views(buffer)
    returns, lengths = [], []
    while quotas.any():
        spaces.write(views, obs)
        with torch.no_grad():  # act() is always called without grad (the API's promise)
            action = policy.act(buffer.to(device), deterministic=deterministic)["action"]
        obs, _, _, _, info = envs.step(action.cpu().numpy())
        if "episode" not in info:
            continue
        for i in np.flatnonzero(info["_episode"] & (quotas > 0)):
            quotas[i] -= 1
            returns.append(float(info["episode"]["r"][i]))
            lengths.append(int(info["episode"]["l"][i]))
    return returns, lengths


def _quotas(episodes: int, num_envs: int) -> np.ndarray:
    """Episodes per env slot: as equal as possible, summing to `episodes`."""
    return np.array([episodes // num_envs + (i < episodes % num_envs) for i in range(num_envs)])


def _make_envs(env_cfg: EnvSection, spec, seed: int, wrappers):
    try:
        return make_vector_env(env_cfg, spec, seed, wrappers=wrappers)
    except gym.error.DependencyNotInstalled as exc:  # rendering needs the env's extra (pygame, mujoco, ...)
        raise UserError(f"env '{env_cfg.id}' cannot render a video: {exc}") from None


def require_moviepy() -> None:
    try:
        import moviepy  # noqa: F401  (gymnasium's RecordVideo writes the files with it)
    except ImportError:
        raise UserError('--video needs moviepy: pip install -e ".[video]"') from None


def _device_of(policy) -> torch.device:
    tensor = next(iter(policy.state_dict().values()), None)
    return tensor.device if tensor is not None else torch.device("cpu")


def cuda_indices(device: torch.device) -> list[int]:
    """The CUDA device whose generator acting may draw from (fork_rng saves and restores exactly these)."""
    if device.type != "cuda":
        return []
    return [device.index if device.index is not None else torch.cuda.current_device()]
