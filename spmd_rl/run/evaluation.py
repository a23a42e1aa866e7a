"""Episodes with a policy on envs of their own: the evaluation during training (`eval.every`) and after it
(`python -m spmd_rl.evaluate`)."""

from __future__ import annotations

import dataclasses
import math
import tempfile
from pathlib import Path

import gymnasium as gym
import numpy as np
import torch

from spmd_rl.config.loading import evaluation_env
from spmd_rl.config.sections import Config, EnvSection
from spmd_rl.envs import spaces
from spmd_rl.envs.backend import EnvBackend, backend_for
from spmd_rl.envs.backends.gymnasium import require_moviepy  # noqa: F401  (spmd_rl.evaluate asks before any work)
from spmd_rl.envs.chunks import executed_steps
from spmd_rl.envs.success import EpisodeSuccess
from spmd_rl.envs.vector import EnvSpec, probe_env
from spmd_rl.interfaces.policy import initial_state
from spmd_rl.roles.acting import act
from spmd_rl.roles.messages import observation_message
from spmd_rl.runtime.errors import UserError, describe_exception

# The episode step limit when neither the caller nor the env's registration gives one: a policy that never ends an
# episode (a Breakout agent that never presses FIRE) must not evaluate forever.
DEFAULT_MAX_STEPS = 100_000


def evaluate(
    policy,
    env_cfg: EnvSection,
    episodes: int,
    seed: int,
    deterministic: bool,
    video_dir: str | Path | None = None,
    max_steps: int | None = None,
) -> dict:
    """Play `episodes` episodes on envs of its own and return their statistics:
    {episodes, deterministic, seed, max_steps, return_mean, return_std, length_mean, length_std, returns, lengths,
    cut} (std over episodes, ddof=0; the lists in the order episodes finished; cut: how many episodes the step
    limit ended, counted when that limit is below the env's own). For an env that reports success
    (EnvSpec.success_key) also success_rate, its 95% Wilson success_interval, success_at_end_rate and successes
    (each episode's (at any step, at the last step)).

    An episode ends after at most `max_steps` steps (truncated, as gymnasium's TimeLimit does); None means the
    env's own limit (env.kwargs' max_episode_steps, else its registration's), else DEFAULT_MAX_STEPS.

    Runs min(episodes, env.num_envs) envs (one with video_dir), seeded from `seed` (env.group_size does not
    apply). Each env slot plays a fixed quota of episodes, so short episodes finishing first do not crowd out long
    ones. The caller's random state is untouched: torch's generators are forked and seeded from `seed` (a call
    during training changes nothing there), and the policy's train/eval mode is restored.

    With env.groups, each group plays `episodes` episodes on envs of its own (same seed, one group after another):
    the statistics are over all of them, and `groups` holds each group's {return_mean, ..., lengths, cut}."""
    if env_cfg.groups:
        return _evaluate_groups(policy, env_cfg, episodes, seed, deterministic, video_dir, max_steps)
    if episodes < 1:
        raise UserError(f"evaluation episodes={episodes}: evaluate at least 1 episode")
    if max_steps is not None and max_steps < 1:
        raise UserError(f"evaluation max_steps={max_steps}: allow at least 1 step per episode")
    backend = backend_for(env_cfg)
    spec = probe_env(env_cfg)
    # Returns are the env's own rewards: reward scaling only matters for learning. An evaluation's episodes are
    # independent draws: env.group_size (GRPO's envs that start together) would seed each block of envs alike, so
    # that they played the same episode (deterministic actions), and an episode count that is no multiple of it
    # failed the groups' start check as if the env's reset were not reproducible.
    env_cfg = dataclasses.replace(
        env_cfg, num_envs=min(episodes, env_cfg.num_envs), normalize_reward=False, group_size=1
    )
    env_limit = backend.step_limit(env_cfg)
    max_steps = max_steps or env_limit or DEFAULT_MAX_STEPS
    wrappers = []
    cuts = env_limit is None or max_steps < env_limit
    if cuts:
        env_cfg, spec, limit_wrappers = backend.limit_steps(env_cfg, spec, max_steps)
        wrappers += limit_wrappers
    if video_dir is not None:
        env_cfg, spec, video_wrappers = backend.record_video(env_cfg, spec, str(video_dir))
        wrappers += video_wrappers
    envs, obs = _make_envs(backend, env_cfg, spec, seed, wrappers or None)

    device = _device_of(policy)
    was_training = policy.training
    try:
        with torch.random.fork_rng(devices=cuda_indices(device)), torch.no_grad():
            torch.default_generator.manual_seed(seed)
            if device.type == "cuda":
                torch.cuda.default_generators[cuda_indices(device)[0]].manual_seed(seed)
            returns, lengths, successes, tasks = _play(
                policy.eval(), spec, envs, obs, _quotas(episodes, envs.num_envs), deterministic, device, env_cfg.id
            )
    finally:
        policy.train(was_training)
        envs.close()  # also writes the last episode's video
    cut = sum(length >= max_steps for length in lengths) if cuts else 0
    summary = _summary(returns, lengths, deterministic, seed, max_steps, cut, successes)
    if successes is not None and len(set(tasks)) > 1 and len(tasks) == len(successes):
        summary["tasks"] = _by_task(tasks, successes)
    return summary


def _by_task(tasks: list[str], successes: list[tuple[bool, bool]]) -> dict:
    """{task: {"episodes", "success_rate"}} in the order tasks first ended, for an env whose info names each
    episode's task (TASK_KEY: MetaWorld's MT10), so that one policy's result over several tasks reads per task."""
    by_task: dict[str, list[bool]] = {}
    for task, (at_any, _) in zip(tasks, successes, strict=True):
        by_task.setdefault(task, []).append(at_any)
    return {task: {"episodes": len(won), "success_rate": sum(won) / len(won)} for task, won in by_task.items()}


def probe_eval_env(cfg: Config) -> EnvSpec:
    """The spaces of the envs evaluation plays on (env with eval.env's changes); an error there names eval.env,
    whose keys the user must fix, not env's."""
    try:
        return probe_env(evaluation_env(cfg))
    except UserError as exc:
        raise UserError(f"eval.env: {exc}") from None


def check_video(env_cfg: EnvSection) -> None:
    """eval.video_every, before the run starts: the video extra is installed, the backend records videos, and one
    env renders one frame (classic control needs pygame, MuJoCo an OpenGL backend); a UserError otherwise, now
    rather than at the first video, hours in. For env.groups, each group's env."""
    for name, section in env_cfg.group_sections() if env_cfg.groups else [(None, env_cfg)]:
        where = f"env group '{name}'" if name else f"env '{section.id}'"
        backend = backend_for(section)
        spec = backend.probe(section)
        with tempfile.TemporaryDirectory() as scratch:
            render_cfg, render_spec, _ = backend.record_video(dataclasses.replace(section, num_envs=1), spec, scratch)
        envs = None
        try:
            envs, _ = _make_envs(backend, render_cfg, render_spec, 0, None)
            frame = envs.unwrapped.call("render")[0]
        except UserError:
            raise
        except Exception as exc:  # the env's renderer: pygame missing, no OpenGL, a factory without render_mode
            hint = " (MuJoCo without a display: MUJOCO_GL=egl or osmesa)" if "OpenGL" in str(exc) else ""
            raise UserError(
                f"eval.video_every: {where} cannot render a frame: {describe_exception(exc)}{hint}"
            ) from None
        finally:
            if envs is not None:
                envs.close()
        if not isinstance(frame, np.ndarray) or frame.ndim != 3:
            raise UserError(
                f"eval.video_every: {where} rendered {type(frame).__name__}, not an RGB frame: its render() must "
                f"return an array (height, width, 3) with render_mode='rgb_array'"
            )


def _summary(
    returns: list, lengths: list, deterministic: bool, seed: int, max_steps: int, cut: int, successes: list | None
) -> dict:
    """What an evaluation returns: its settings, the statistics of its episodes, and the episodes themselves; for
    an env that reports success, each episode's (success at any step, at the last step) and their rates."""
    summary = {
        "episodes": len(returns),
        "deterministic": deterministic,
        "seed": seed,
        "max_steps": max_steps,
        "return_mean": float(np.mean(returns)),
        "return_std": float(np.std(returns)),
        "length_mean": float(np.mean(lengths)),
        "length_std": float(np.std(lengths)),
        "returns": returns,
        "lengths": lengths,
        "cut": cut,
    }
    if successes is not None:
        succeeded = sum(at_any for at_any, _ in successes)
        summary.update(
            success_rate=succeeded / len(successes),
            success_interval=wilson_interval(succeeded, len(successes)),
            success_at_end_rate=sum(at_end for _, at_end in successes) / len(successes),
            successes=successes,
        )
    return summary


def wilson_interval(successes: int, trials: int, z: float = 1.959964) -> tuple[float, float]:
    """The Wilson score interval of a success rate (95% by default): unlike the normal approximation it stays
    inside [0, 1] and is not empty at 0 or `trials` successes."""
    rate = successes / trials
    center = (rate + z * z / (2 * trials)) / (1 + z * z / trials)
    half = z / (1 + z * z / trials) * math.sqrt(rate * (1 - rate) / trials + z * z / (4 * trials * trials))
    return max(0.0, center - half), min(1.0, center + half)


def _evaluate_groups(policy, env_cfg: EnvSection, episodes: int, seed: int, deterministic: bool, video_dir, max_steps):
    groups = {
        name: evaluate(
            policy,
            section,
            episodes,
            seed,
            deterministic,
            None if video_dir is None else Path(video_dir) / name,
            max_steps,
        )
        for name, section in env_cfg.group_sections()
    }
    returns = [value for result in groups.values() for value in result["returns"]]
    lengths = [value for result in groups.values() for value in result["lengths"]]
    max_steps = max(result["max_steps"] for result in groups.values())
    cut = sum(result["cut"] for result in groups.values())
    reported = all("successes" in result for result in groups.values())
    successes = [value for result in groups.values() for value in result["successes"]] if reported else None
    return {**_summary(returns, lengths, deterministic, seed, max_steps, cut, successes), "groups": groups}


TASK_KEY = "task"  # an info key naming each env's task (MetaWorld's envs); evaluations of several report per task


def episode_step_limit(env_cfg: EnvSection) -> int | None:
    """The env's own episode step limit (its backend's: for gymnasium env.kwargs' max_episode_steps, else its
    registration's); None if none."""
    return backend_for(env_cfg).step_limit(env_cfg)


def _play(policy, spec, envs, obs, quotas: np.ndarray, deterministic: bool, device: torch.device, env_id: str):
    buffer = observation_message(spec, envs.num_envs)["obs"]  # the layout the inference server acts on
    views = spaces.numpy_views(buffer)
    returns, lengths, tasks = [], [], []
    fields = policy.recurrent_state()
    state = initial_state(fields, envs.num_envs, device) if fields else None
    # A recurrent state starts afresh where the envs hand over a new episode's first observation: after the reset
    # step that follows an episode's end (NEXT_STEP autoreset), as the inference server does in training.
    starts = np.ones(envs.num_envs, dtype=bool)
    ended = np.zeros(envs.num_envs, dtype=bool)
    success = EpisodeSuccess(spec.success_key, envs.num_envs) if spec.success_key is not None else None
    successes: list[tuple[bool, bool]] | None = [] if success is not None else None
    # With action chunks an episode's length is its primitive steps (the vector env's statistics count decisions).
    primitive_steps = np.zeros(envs.num_envs, dtype=np.int64) if spec.action_chunk > 1 else None
    # NaN or inf from the env, named as the env ranks name it in training (exit 4): unchecked, the policy acted on
    # it and the evaluation reported a return as if nothing were wrong (fault pass 9, N1)
    spaces.check_finite("evaluation", env_id, obs, None, "evaluation step 0")
    step = 0
    while quotas.any():
        spaces.write(views, obs)
        if state is not None:
            fresh = torch.as_tensor(starts, device=device)
            for name, field in fields.items():
                state[name][fresh] = field.initial
        out, state = act(policy, buffer, device, deterministic, state)
        obs, reward, terminated, truncated, info = envs.step(out["action"].cpu().numpy())
        step += 1
        spaces.check_finite("evaluation", env_id, obs, reward, f"evaluation step {step}")
        starts, ended = ended, terminated | truncated  # this step reset the envs that had ended before it
        if success is not None:
            at_any, at_end = success.step(info, ~starts, ended)
        if primitive_steps is not None:
            primitive_steps += executed_steps(info, envs.num_envs)
        if "episode" not in info:
            continue
        episode_lengths = info["episode"]["l"] if primitive_steps is None else primitive_steps.copy()
        for i in np.flatnonzero(info["_episode"] & (quotas > 0)):
            quotas[i] -= 1
            returns.append(float(info["episode"]["r"][i]))
            lengths.append(int(episode_lengths[i]))
            if success is not None:
                assert successes is not None  # made with success
                successes.append((bool(at_any[i]), bool(at_end[i])))
            if TASK_KEY in info:  # the ending step's info is the episode's (the next step resets)
                tasks.append(str(info[TASK_KEY][i]))
        if primitive_steps is not None:
            primitive_steps[info["_episode"]] = 0
    return returns, lengths, successes, tasks


def _quotas(episodes: int, num_envs: int) -> np.ndarray:
    """Episodes per env slot: as equal as possible, summing to `episodes`."""
    return np.array([episodes // num_envs + (i < episodes % num_envs) for i in range(num_envs)])


def _make_envs(backend: EnvBackend, env_cfg: EnvSection, spec, seed: int, wrappers):
    try:
        return backend.make(env_cfg, spec, seed, wrappers=wrappers)
    except gym.error.DependencyNotInstalled as exc:  # rendering needs the env's extra (pygame, mujoco, ...)
        raise UserError(f"env '{env_cfg.id}' cannot render a video: {exc}") from None


def _device_of(policy) -> torch.device:
    tensor = next(iter(policy.state_dict().values()), None)
    return tensor.device if tensor is not None else torch.device("cpu")


def cuda_indices(device: torch.device) -> list[int]:
    """The CUDA device whose generator acting may draw from (fork_rng saves and restores exactly these)."""
    if device.type != "cuda":
        return []
    return [device.index if device.index is not None else torch.cuda.current_device()]
