"""The EnvBackend contract: everything the framework asks of a kind of vector env, so that no other file tests a
backend's name. `env.backend` names one: `gymnasium` (envs/backends/gymnasium.py), `envpool`
(envs/backends/envpool.py), or a user's `package.module:Class` subclassing spmd_rl.api.EnvBackend.

A backend's vector envs follow gymnasium's VectorEnv API with NEXT_STEP autoreset (the step that ends an episode
returns its final observation; the next step of that env only resets it), and report finished episodes as
gymnasium's RecordEpisodeStatistics does (info["episode"] = {"r", "l"}, info["_episode"] the mask).
"""

from __future__ import annotations

from dataclasses import dataclass

import gymnasium as gym
import numpy as np
from gymnasium.wrappers import vector as vector_wrappers

from spmd_rl.config import plugins
from spmd_rl.config.excerpts import clip
from spmd_rl.config.sections import EnvSection
from spmd_rl.envs.text import TokenizeText, has_text
from spmd_rl.runtime.errors import UserCodeError, UserError, describe_exception


@dataclass(frozen=True)
class EnvSpec:
    """What every rank must know about the env, without stepping it: the spaces of ONE env."""

    id: str
    observation_space: gym.Space
    action_space: gym.Space
    vectorization: str = "sync"  # the resolved env.vectorization (a backend's own name where it vectorizes itself)
    # The keys of one step's info, where the backend's probe stepped an env (envs/success.py reads env.success_key
    # there); empty where it did not.
    step_info_keys: frozenset = frozenset()
    success_key: str | None = None  # the info key of the success flag, where the env reports one (probe_env sets it)
    # env.action_chunk: primitive steps per decision (K). With K > 1, action_space is the chunk's, Box [K, *shape]
    # (envs/chunks.py), which is what the policy acts in and the vector env takes.
    action_chunk: int = 1
    # Whether a rollout is whole episodes (the algorithm's Schedule.rollout_unit, set from the plan): each rollout
    # starts every env from a reset, and segments carry rollout["active"].
    episodes: bool = False
    # A line for rank 0 to print at start about how the envs run (MetaWorld's: which renderer it chose); "" for none.
    note: str = ""


class EnvBackend:
    """One kind of vector env. Override `probe` and `make`; the rest have defaults that fit gymnasium-style envs.

    Every method takes the env section it acts on (env, one of env.groups' sections, or evaluation's env), so one
    backend object serves them all."""

    # Whether one vector env can hold envs of several ids / kwargs side by side (env.groups); False refuses
    # env.groups when the config is loaded, with `groups_refusal` as the reason.
    takes_groups: bool = True
    groups_refusal: str = "its vector envs run one id with one set of kwargs"
    # Whether its make builds every env itself and so takes the per-env settings: env.action_chunk > 1 (a wrapper
    # on each env, envs/chunks.py), env.group_size > 1 (a seed per env at the first reset, finish_vector_env) and
    # env.max_episode_steps (a TimeLimit on each env); False refuses them when the backend is looked up.
    takes_per_env_settings: bool = False

    def probe(self, cfg: EnvSection) -> EnvSpec:
        """The spaces of one env (of every group with env.groups; they must agree), without a process group, and
        where it can, the keys of one step's info (EnvSpec.step_info_keys: how success metrics learn that the env
        reports env.success_key). Bad ids or kwargs are a UserError naming the env."""
        raise NotImplementedError

    def make(self, cfg: EnvSection, spec: EnvSpec, seed: int, wrappers: list | None = None):
        """(vector env, first observation batch): cfg.num_envs envs seeded from `seed`, with episode statistics
        and the shared wrappers (finish_vector_env). `wrappers` wrap each single env (evaluation's step limit and
        video); a backend that takes none refuses them with a UserError."""
        raise NotImplementedError

    def step_limit(self, cfg: EnvSection) -> int | None:
        """The episode step limit the envs apply by themselves (None: none known)."""
        return None

    def limit_steps(self, cfg: EnvSection, spec: EnvSpec, max_steps: int) -> tuple[EnvSection, EnvSpec, list]:
        """Evaluation's step limit, below the env's own: (section, spec, per-env wrappers) whose envs truncate
        episodes after `max_steps` steps."""
        raise UserError(f"env.backend={clip(cfg.backend)} cannot limit an evaluation's episodes to {max_steps} steps")

    def record_video(self, cfg: EnvSection, spec: EnvSpec, video_dir: str) -> tuple[EnvSection, EnvSpec, list]:
        """Evaluation's --video: (section, spec, per-env wrappers) whose envs write every episode's video."""
        raise UserError(f"--video: env.backend={clip(cfg.backend)} records no videos")

    def steps_without_the_gil(self, cfg: EnvSection) -> bool:
        """Whether the envs' step waits without holding this process's GIL: its work runs in other processes or in
        native threads (env.pipeline_stages in one process overlaps the policy with such steps only; False refuses
        them there)."""
        return False

    def hang_advice(self, cfg: EnvSection, spec: EnvSpec) -> str:
        """What to try when making, resetting or stepping these envs hangs, said in parentheses after the watched
        call in the watchdog's line (' (in 2 env worker processes started by fork; ...)'); '' for nothing to add."""
        return ""

    def capture_state(self, envs) -> dict | None:
        """The envs' state for a checkpoint, or None when it cannot be saved (unsaved_reason says why)."""
        return None

    def restore_state(self, envs, state: dict) -> None:
        """Put a state from capture_state into envs made by the same config (and reset)."""

    def unsaved_reason(self, envs) -> str | None:
        """One line saying why a checkpoint cannot hold these envs' state (a resume begins fresh episodes); None
        when it can."""
        return "the env's state cannot be saved in checkpoints by this backend: a resume begins fresh episodes"


def backend_for(cfg: EnvSection) -> EnvBackend:
    """The backend env.backend names, ready to use."""
    backend = plugins.load_class(plugins.ENV_BACKEND, cfg.backend, EnvBackend)()
    if not backend.takes_per_env_settings:
        asked = [("action_chunk", 1), ("group_size", 1), ("max_episode_steps", 0)]
        for key, default in asked:
            if getattr(cfg, key) != default:
                raise UserError(
                    f"env.{key}={getattr(cfg, key)} needs env.backend=gymnasium (env.backend={clip(cfg.backend)} "
                    f"does not build its envs one by one); set env.{key}={default} or env.backend=gymnasium"
                )
    return backend


def group_seeds(seed: int, num_envs: int, group_size: int) -> int | list[int]:
    """The first reset's seed: `seed` (env i then takes seed + i, gymnasium's rule), or with env.group_size G > 1 one
    seed per env, seed + i // G, the same for every env of a block of G, so that the block starts together."""
    if group_size == 1:
        return seed
    return [seed + i // group_size for i in range(num_envs)]


def check_group_starts(obs, group_size: int, env_id: str) -> None:
    """The contract of env.group_size: the envs of a group were reset with one seed, so their first observations
    must be equal (a UserCodeError naming the groups, and which observation differs by how much, otherwise: the
    env's seeded reset is not reproducible)."""
    if group_size == 1:
        return
    differing = differing_blocks(obs, group_size)
    if differing:
        raise UserCodeError(
            f"env '{clip(env_id)}': the envs of group(s) {differing[:8]} (env.group_size={group_size}) were reset "
            f"with one seed but returned different first observations ({clip(describe_difference(obs, group_size))}); "
            f"an env must return the same initial state for the same seed (docs/envs.md, 'Groups that start "
            f"together'): make its seeded reset reproducible in a wrapper of its own (e.g. the seed chooses a task "
            f"configuration), or set env.group_size=1"
        )


def differing_blocks(values, block: int) -> list[int]:
    """The indices of the blocks of `block` consecutive envs (first dimension) whose values are not all equal (an
    array, or a dict of them for Dict observations)."""
    if isinstance(values, dict):
        return sorted({i for value in values.values() for i in differing_blocks(value, block)})
    array = np.asarray(values)
    blocks = array.reshape(array.shape[0] // block, block, -1)
    return np.flatnonzero(~(blocks == blocks[:, :1]).all(axis=(1, 2))).tolist()


def describe_difference(values, block: int, key: str = "") -> str:
    """Which observation (a Dict's keys) differs within a block of envs, and its largest difference from the block's
    first env, e.g. "'state' by up to 0.0031, 'image' by up to 255"."""
    if isinstance(values, dict):
        parts = (describe_difference(value, block, f"{key}/{name}" if key else name) for name, value in values.items())
        return ", ".join(part for part in parts if part)
    array = np.asarray(values)
    if not differing_blocks(array, block):
        return ""
    blocks = array.reshape(array.shape[0] // block, block, -1)
    if array.dtype.kind in "biuf":
        gap = np.abs(blocks.astype(np.float64) - blocks[:, :1].astype(np.float64)).max()
        return f"'{key}' by up to {gap:.3g}" if key else f"by up to {gap:.3g}"
    return f"'{key}'" if key else "its values"


def differing_space(spec: EnvSpec, other: EnvSpec) -> tuple[str, str, str] | None:
    """(which space, spec's, other's), each said briefly, for the first space that differs; None if both agree."""
    for name in ("observation_space", "action_space"):
        if getattr(other, name) != getattr(spec, name):
            return name.replace("_", " "), clip(str(getattr(spec, name))), clip(str(getattr(other, name)))
    return None


def finish_vector_env(envs, cfg: EnvSection, seed: int, reset_seed: int | None):
    """The wrappers every backend's envs share (action clipping, env.normalize_reward, text observations as token
    ids), then the first reset: (envs, first observations)."""
    if isinstance(envs.single_action_space, gym.spaces.Box):
        envs = vector_wrappers.ClipAction(envs)  # the policy's Gaussian samples are unbounded
    if cfg.normalize_reward:
        normalize = EpisodicNormalizeReward if cfg.normalize_reward_reset == "done" else vector_wrappers.NormalizeReward
        envs = normalize(envs, gamma=cfg.normalize_reward_gamma)
    if cfg.clip_reward > 0:
        envs = vector_wrappers.ClipReward(envs, -cfg.clip_reward, cfg.clip_reward)
    if has_text(envs.single_observation_space):
        envs = TokenizeText(envs, cfg)  # strings become token ids here, on the env rank
    seeds = None if reset_seed is None else group_seeds(reset_seed, envs.num_envs, cfg.group_size)
    try:
        obs, _ = envs.reset(seed=seeds)
    except UserError:  # a first instruction longer than env.max_text_tokens
        raise
    except Exception as exc:  # the env's own reset: its error and file:line, not the vector env's stack
        raise UserCodeError(
            f"env.id '{clip(cfg.id)}': reset failed: {describe_exception(exc)}{old_gym_api_hint(exc)}"
        ) from None
    if seeds is not None:  # the groups were seeded: their members start together
        check_group_starts(obs, cfg.group_size, cfg.id)
    envs.action_space.seed(seed)
    return envs, obs


class EpisodicNormalizeReward(vector_wrappers.NormalizeReward):
    """env.normalize_reward_reset=done: Stable-Baselines3 VecNormalize's running return, which adds each reward and
    then restarts after every episode end, truncations too. gymnasium's NormalizeReward (the default) restarts it
    only at a termination, and at that step before adding its reward. The state (return_rms, accumulated_reward,
    _prev_dones) is the parent's, so it saves and resumes as that does (envs/gymnasium_state.py)."""

    def step(self, actions):
        obs, reward, terminated, truncated, info = self.env.step(actions)
        # NEXT_STEP autoreset: the step after an episode end only resets that env, no transition to count.
        active = ~self._prev_dones.astype(bool)
        if self._autoreset_mode == gym.vector.AutoresetMode.SAME_STEP:
            active[:] = True
        self.accumulated_reward[active] = self.accumulated_reward[active] * self.gamma + reward[active]
        if self._update_running_mean and active.any():
            self.return_rms.update(self.accumulated_reward[active])
        done = terminated | truncated
        self.accumulated_reward[done] = 0
        self._prev_dones = done.astype(np.float32)
        return obs, reward / np.sqrt(self.return_rms.var + self.epsilon), terminated, truncated, info


def old_gym_api_hint(exc: Exception) -> str:
    """A hint when a reset or step looks written for the old gym API (its results could not be unpacked)."""
    if isinstance(exc, (ValueError, TypeError)) and "unpack" in str(exc):
        return (
            "; gymnasium's reset returns (observation, info) and step (observation, reward, terminated, truncated, "
            "info): an env written for the old gym API (reset returning only the observation) must be updated"
        )
    return ""
