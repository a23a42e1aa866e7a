"""Evaluate a trained policy: `python -m spmd_rl.evaluate RUN_DIR|CHECKPOINT [--episodes N] [--deterministic]
[--seed S] [--video DIR] [--json] [--device cpu] [section.key=value ...]`.

In Python, one line loads a policy that acts like the trained one:

    policy, cfg = load_policy("runs/ppo_cartpole-20250101-120000")     # run dir, checkpoint dir or .pt file
    action = policy.act(obs_batch, deterministic=True)["action"]
    result = evaluate(policy, cfg.env, episodes=10, seed=0, deterministic=True)

A run directory gives its final policy.pt, or its latest checkpoint while the run has not finished. The policy is
built from the run's config.yaml (the same class, keys and seed as in training), then its weights are loaded.

Video (--video DIR) records every evaluated episode of one env with gymnasium's RecordVideo; it needs the optional
extra: pip install -e ".[video]".
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from pathlib import Path

import numpy as np
import torch

from spmd_rl.checkpoint import CHECKPOINTS_DIR, COMPLETE, find_checkpoint, load_checkpoint
from spmd_rl.config import EnvSection, load_config
from spmd_rl.errors import USER_ERROR_EXIT_CODE, UserError

CONFIG_FILE = "config.yaml"
POLICY_FILE = "policy.pt"
CHECKPOINT_POLICY_KEY = "policy"  # rank 0's checkpoint file holds the Policy's state_dict under this key
_RANK_FILE = re.compile(r"rank(\d+)\.pt")


def load_policy(path: str | Path, device: str | torch.device = "cpu", config_overrides=()):
    """(policy, cfg): the trained Policy, in eval mode on `device`, and the run's Config (config.yaml with
    `section.key=value` overrides). `path` is a run directory, a checkpoint directory (or a run's checkpoints/),
    or a policy.pt / checkpoint rank0.pt file. Any failure is a one-line UserError naming the path."""
    path = Path(path)
    weights = _weights_location(path)
    config_file = _config_next_to(weights)
    device = _device(device)
    state = _read_policy_state(weights)

    from spmd_rl.engine import build_policy
    from spmd_rl.envs import probe_env
    from spmd_rl.plugins import POLICY, load_class
    try:  # the run's classes must still import (load_config imports a user's policy to read its Config)
        cfg = load_config(config_file, list(config_overrides))
        spec = probe_env(cfg.env)
        policy_cls = load_class(POLICY, cfg.classes["policy"])
    except UserError as exc:
        raise UserError(str(exc) if str(config_file) in str(exc) else f"{config_file}: {exc}") from None
    with torch.random.fork_rng(devices=_cuda_indices(device)):  # build_policy seeds torch: keep the caller's RNG
        policy = build_policy(cfg, spec, policy_cls, device)
    try:
        policy.load_state_dict(state)
    except RuntimeError as exc:  # missing / unexpected keys, shape mismatches
        detail = " ".join(str(exc).split())
        detail = detail if len(detail) <= 300 else detail[:300] + " ..."
        raise UserError(f"{weights}: its weights do not fit policy.class '{cfg.classes['policy']}' built from "
                        f"{config_file} (was the config changed?): {detail}") from None
    # An acting copy: no parameter needs grad, so act()'s outputs convert to numpy without a no_grad block.
    return policy.eval().requires_grad_(False), cfg


def read_trained_state(path: str | Path, with_algorithm: bool = False) -> tuple[dict, dict | None]:
    """(the Policy's state_dict, the Algorithm's state or None) of a run directory, checkpoint or policy file:
    what `run.init_from` starts a new run from. The algorithm's state exists only in checkpoints."""
    path = Path(path)
    # The algorithm's state lives in checkpoints: from a run directory, take its latest one, not policy.pt.
    weights = find_checkpoint(path) if with_algorithm and path.is_dir() else _weights_location(path)
    policy_state = _read_policy_state(weights)
    if not with_algorithm:
        return policy_state, None
    checkpoint = weights if weights.is_dir() else (weights.parent if (weights.parent / COMPLETE).exists() else None)
    if checkpoint is None:
        raise UserError(f"run.init_algorithm=true needs a checkpoint, and {path} gives {weights} (a policy file "
                        f"holds no algorithm state); point run.init_from at a checkpoint or its run directory")
    return policy_state, load_checkpoint(checkpoint, rank=0)["algorithm"]


def evaluate(policy, env_cfg: EnvSection, episodes: int, seed: int, deterministic: bool,
             video_dir: str | Path | None = None) -> dict:
    """Play `episodes` episodes on envs of its own and return their statistics:
    {episodes, deterministic, seed, return_mean, return_std, length_mean, length_std, returns, lengths}
    (std over episodes, ddof=0; the lists in the order episodes finished).

    Runs min(episodes, env.num_envs) envs (one with video_dir), seeded from `seed`. Each env slot plays a fixed
    quota of episodes, so short episodes finishing first do not crowd out long ones. The caller's random state is
    untouched: torch's generators are forked and seeded from `seed` (a call during training changes nothing there),
    and the policy's train/eval mode is restored."""
    from spmd_rl.envs import make_vector_env, probe_env
    if episodes < 1:
        raise UserError(f"evaluation episodes={episodes}: evaluate at least 1 episode")
    spec = probe_env(env_cfg)
    # Returns are the env's own rewards: reward scaling only matters for learning.
    env_cfg = dataclasses.replace(env_cfg, num_envs=min(episodes, env_cfg.num_envs), normalize_reward=False)
    wrappers = None
    if video_dir is not None:
        _require_moviepy()
        from gymnasium.wrappers import RecordVideo
        env_cfg = dataclasses.replace(env_cfg, num_envs=1, kwargs={**env_cfg.kwargs, "render_mode": "rgb_array"})
        spec = dataclasses.replace(spec, vectorization="sync")  # RecordVideo wraps a single env
        wrappers = [lambda env: RecordVideo(env, str(video_dir), episode_trigger=lambda _: True,
                                            name_prefix="eval")]
    envs, obs = _make_envs(make_vector_env, env_cfg, spec, seed, wrappers)

    device = _device_of(policy)
    was_training = policy.training
    try:
        with torch.random.fork_rng(devices=_cuda_indices(device)), torch.no_grad():
            torch.default_generator.manual_seed(seed)
            if device.type == "cuda":
                torch.cuda.default_generators[_cuda_indices(device)[0]].manual_seed(seed)
            returns, lengths = _play(policy.eval(), spec, envs, obs, _quotas(episodes, envs.num_envs),
                                     deterministic, device)
    finally:
        policy.train(was_training)
        envs.close()  # also writes the last episode's video
    return {"episodes": episodes, "deterministic": deterministic, "seed": seed,
            "return_mean": float(np.mean(returns)), "return_std": float(np.std(returns)),
            "length_mean": float(np.mean(lengths)), "length_std": float(np.std(lengths)),
            "returns": returns, "lengths": lengths}


def _play(policy, spec, envs, obs, quotas: np.ndarray, deterministic: bool, device: torch.device):
    from spmd_rl import spaces
    from spmd_rl.roles.messages import observation_message
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


def _make_envs(make_vector_env, env_cfg: EnvSection, spec, seed: int, wrappers):
    import gymnasium as gym
    try:
        return make_vector_env(env_cfg, spec, seed, wrappers=wrappers)
    except gym.error.DependencyNotInstalled as exc:  # rendering needs the env's extra (pygame, mujoco, ...)
        raise UserError(f"env '{env_cfg.id}' cannot render a video: {exc}") from None


def _require_moviepy() -> None:
    try:
        import moviepy  # noqa: F401  (gymnasium's RecordVideo writes the files with it)
    except ImportError:
        raise UserError('--video needs moviepy: pip install -e ".[video]"') from None


# -- locating and reading the weights ----------------------------------------------------------------------------

def _weights_location(path: Path) -> Path:
    """The policy file or checkpoint directory that `path` means."""
    if not path.exists():
        raise UserError(f"{path} does not exist: give a run directory, a checkpoint directory or a {POLICY_FILE}")
    if path.is_file():
        return path
    if (path / POLICY_FILE).is_file():
        return path / POLICY_FILE
    if (path / CONFIG_FILE).is_file() and not (path / CHECKPOINTS_DIR).is_dir():
        raise UserError(f"run directory {path} holds no weights yet (no {POLICY_FILE}, no {CHECKPOINTS_DIR}/)")
    return find_checkpoint(path)


def _config_next_to(weights: Path) -> Path:
    """The run's config.yaml: next to a policy file, or up in the run directory (a checkpoint directory is
    <run dir>/checkpoints/iter_N, its rank files one level deeper)."""
    start = weights if weights.is_dir() else weights.parent
    for directory in (start, *list(start.parents)[:3]):
        if (directory / CONFIG_FILE).is_file():
            return directory / CONFIG_FILE
    raise UserError(f"no {CONFIG_FILE} next to {weights} or in the run directory above it: the policy is built "
                    f"from the run's config; copy the run's {CONFIG_FILE} next to the weights")


def _read_policy_state(weights: Path) -> dict:
    if weights.is_dir():
        state = load_checkpoint(weights, rank=0)
        source = weights / "rank0.pt"
    else:
        source = weights
        match = _RANK_FILE.fullmatch(weights.name)
        if match and (weights.parent / COMPLETE).exists():  # through the checkpoint's own size check
            state = load_checkpoint(weights.parent, rank=int(match.group(1)))
        else:
            state = _torch_load(weights)
    if isinstance(state, dict) and isinstance(state.get(CHECKPOINT_POLICY_KEY), dict):
        state = state[CHECKPOINT_POLICY_KEY]
    elif weights.is_dir() or _RANK_FILE.fullmatch(weights.name):
        raise UserError(f"{source} holds no '{CHECKPOINT_POLICY_KEY}' entry: give the checkpoint directory (the "
                        f"policy is in its rank0.pt)")
    if not (isinstance(state, dict) and state and all(isinstance(v, torch.Tensor) for v in state.values())):
        raise UserError(f"{source} holds no policy weights (expected a Policy's state_dict, as policy.pt holds)")
    return state


def _torch_load(file: Path):
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises several types for damaged or foreign files; each means the same here
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"{file} cannot be read as weights ({first_line}): is it a complete {POLICY_FILE} or "
                        f"checkpoint file?") from None


# -- devices -----------------------------------------------------------------------------------------------------

def _device(name: str | torch.device) -> torch.device:
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UserError(f"device '{name}' is not a torch device: use cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"device '{name}': CUDA is not available here; use --device cpu")
    return device


def _device_of(policy) -> torch.device:
    tensor = next(iter(policy.state_dict().values()), None)
    return tensor.device if tensor is not None else torch.device("cpu")


def _cuda_indices(device: torch.device) -> list[int]:
    """The CUDA device whose generator acting may draw from (fork_rng saves and restores exactly these)."""
    if device.type != "cuda":
        return []
    return [device.index if device.index is not None else torch.cuda.current_device()]


# -- command line ------------------------------------------------------------------------------------------------

class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, like every other bad input (argparse's default adds the usage)
        self.exit(USER_ERROR_EXIT_CODE, f"{self.prog}: error: {message} (see --help)\n")


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="python -m spmd_rl.evaluate", description="Evaluate a trained policy on its env.")
    parser.add_argument("path", type=Path, metavar="RUN_DIR|CHECKPOINT",
                        help="a run directory, a checkpoint directory, or a policy.pt / rank0.pt file")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value",
                        help="changes to the run's config (e.g. env.kwargs), as for spmd_rl.main")
    parser.add_argument("--episodes", type=int, default=10, help="episodes to evaluate (default: %(default)s)")
    parser.add_argument("--deterministic", action="store_true", help="act with the policy's mode, not a sample")
    parser.add_argument("--seed", type=int, default=0, help="seeds the envs and the policy's sampling (default: 0)")
    parser.add_argument("--video", type=Path, metavar="DIR", help="record every episode of one env as mp4 in DIR")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")
    parser.add_argument("--device", default="cpu", help="torch device to act on (default: cpu)")
    args = parser.parse_args(argv)
    try:
        if args.episodes < 1:
            raise UserError(f"--episodes {args.episodes}: evaluate at least 1 episode")
        if args.seed < 0:
            raise UserError(f"--seed {args.seed}: give a seed >= 0")
        if args.video is not None:
            _require_moviepy()  # before any work: the one thing to install
        policy, cfg = load_policy(args.path, args.device, args.overrides)
        result = evaluate(policy, cfg.env, args.episodes, args.seed, args.deterministic, args.video)
    except UserError as exc:
        print(f"spmd_rl.evaluate: error: {exc}", file=sys.stderr)
        return USER_ERROR_EXIT_CODE
    if args.json:
        print(json.dumps({"path": str(args.path), "env": cfg.env.id, **result}))
    else:
        actions = "deterministic" if args.deterministic else "sampled"
        print(f"{args.path} on {cfg.env.id}: return {result['return_mean']:.2f} ± {result['return_std']:.2f}, "
              f"length {result['length_mean']:.1f} ± {result['length_std']:.1f} over {args.episodes} episodes "
              f"({actions} actions, seed {args.seed})" + (f"; videos in {args.video}" if args.video else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
