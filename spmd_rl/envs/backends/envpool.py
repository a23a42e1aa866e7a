"""The EnvPool backend (`env.backend: envpool`): C++ vectorized envs (Atari, MuJoCo, classic control, ...) behind
the gymnasium vector API, so the env runner steps them exactly as it steps gymnasium's vector envs.

EnvPool's gymnasium envs are gymnasium VectorEnvs with NEXT_STEP autoreset, the mode the framework expects: the
step that ends an episode returns its final observation, and the next step of that env only resets it (reward 0,
the action ignored). The same holds for a lost life under `episodic_life`: the env reports `terminated`, and its next
step is a reset step that continues the same game.

Episode statistics count whole games: under `episodic_life` a lost life ends a training episode (the value is not
bootstrapped past it) but not the game, and under `reward_clip` the reward the learner sees is clipped; the
returns reported are the game's own score (EnvPool's info["reward"]) summed until the game ends (info["terminated"])
or is truncated, which is what Atari results are quoted in.

Pipeline stages (env.pipeline_stages S > 1) are one pool per stage, made with the stage's first seed: EnvPool seeds
env i of a pool made with seed s with s + i, so the stages' envs are those of one pool of the rank's envs (checked
step by step in tests/runs/test_pipeline_envpool.py). In one process each stage's pool steps on a thread of its own
(roles/env_step_thread.py) while the policy acts for another stage: EnvPool's step waits for its C++ threads without
holding the GIL (steps_without_the_gil). One pool with EnvPool's own asynchronous interface (send, and recv of
batch_size < num_envs envs) cannot be the stages: recv hands back whichever batch_size envs finish first (with 8
envs in batches of 4, 200 recvs gave 16-20 different sets of env ids), so a stage would not be a fixed set of envs
and the policy's batches, and with them the order its random numbers are drawn in, would depend on timing: not S =
1's run, and not the same run twice.

envpool is imported only when this backend is used: importing it takes ~2 s.
"""

from __future__ import annotations

import dataclasses
import warnings

import gymnasium as gym
import numpy as np

from spmd_rl.config.excerpts import MESSAGE_CHARS, clip, excerpt
from spmd_rl.config.sections import EnvSection
from spmd_rl.envs.backend import EnvBackend, EnvSpec, finish_vector_env
from spmd_rl.runtime.errors import UserError

INSTALL = 'pip install -e ".[envpool]"'


class EnvPoolBackend(EnvBackend):
    takes_groups = False
    groups_refusal = "an EnvPool pool runs one id with one set of kwargs"

    def steps_without_the_gil(self, cfg: EnvSection) -> bool:
        return True  # its step waits for its C++ threads with the GIL released (see the module docstring)

    def probe(self, cfg: EnvSection) -> EnvSpec:
        if cfg.vectorization != "auto":
            raise UserError(
                f"env.vectorization={cfg.vectorization} applies to env.backend=gymnasium; EnvPool vectorizes in C++ "
                f"(its threads: env.kwargs.num_threads): leave env.vectorization at auto"
            )
        observation_space, action_space = probe_envpool(cfg.id, cfg.kwargs)
        return EnvSpec(cfg.id, observation_space, action_space, "envpool")

    def make(self, cfg: EnvSection, spec: EnvSpec, seed: int, wrappers: list | None = None):
        if wrappers:
            raise UserError(
                f"env.backend=envpool: env '{clip(cfg.id)}' takes no per-env gymnasium wrappers (a video, a step "
                f"limit of its own); use env.backend=gymnasium for that, or EnvPool's own env.kwargs "
                f"(max_episode_steps)"
            )
        envs = GameEpisodeStatistics(make_envpool(cfg.id, cfg.num_envs, seed, cfg.kwargs))
        return finish_vector_env(envs, cfg, seed, reset_seed=None)  # its seed is fixed when made

    def step_limit(self, cfg: EnvSection) -> int | None:
        return envpool_step_limit(cfg.id, cfg.kwargs)

    def limit_steps(self, cfg: EnvSection, spec: EnvSpec, max_steps: int):
        """EnvPool's envs take no wrappers; they truncate by themselves."""
        return dataclasses.replace(cfg, kwargs={**cfg.kwargs, "max_episode_steps": max_steps}), spec, []

    def record_video(self, cfg: EnvSection, spec: EnvSpec, video_dir: str):
        raise UserError("--video records through gymnasium's wrappers: evaluate with env.backend=gymnasium")

    def unsaved_reason(self, envs) -> str | None:
        return (
            "the env's state cannot be saved in checkpoints (EnvPool's envs run in C++ and do not expose their "
            "state): a resume begins fresh episodes"
        )


def import_envpool():
    try:
        import envpool
    except ImportError as exc:
        raise UserError(
            f"env.backend=envpool needs the envpool package ({clip(str(exc), MESSAGE_CHARS)}): {INSTALL}, or use "
            f"env.backend=gymnasium"
        ) from None
    return envpool


def check_envpool_id(env_id: str):
    """The envpool module, once env.id is known to be one of its ids."""
    envpool = import_envpool()
    if env_id not in envpool.list_all_envs():
        stem = env_id.rsplit("-v", 1)[0].lower()  # Breakout-v4 -> breakout: suggest the versions it has
        similar = [known for known in envpool.list_all_envs() if stem and stem in known.lower()][:5]
        hint = f" (similar: {', '.join(similar)})" if similar else ""
        raise UserError(
            f"env.id '{clip(env_id)}' is not an EnvPool id{hint}: use one of envpool.list_all_envs() "
            f"(e.g. Breakout-v5, CartPole-v1), or env.backend=gymnasium for gymnasium's ids"
        )
    return envpool


def make_envpool(env_id: str, num_envs: int, seed: int, kwargs: dict):
    """EnvPool's gymnasium vector env. Its seeds are fixed when it is made (env i of a pool seeded s gets its own
    stream from s); env.kwargs pass on to envpool.make (frame_skip, episodic_life, reward_clip, num_threads, ...)."""
    envpool = check_envpool_id(env_id)
    try:
        return envpool.make(env_id, env_type="gymnasium", num_envs=num_envs, seed=seed, **kwargs)
    except (TypeError, ValueError, AssertionError, RuntimeError) as exc:
        raise UserError(
            f"env.id '{clip(env_id)}' (env.backend=envpool) rejected env.kwargs {excerpt(kwargs)}: "
            f"{clip(str(exc), MESSAGE_CHARS)}"
        ) from None


def probe_envpool(env_id: str, kwargs: dict) -> tuple[gym.Space, gym.Space]:
    """The spaces of one env."""
    with warnings.catch_warnings():  # its spaces' own casting warnings (CartPole's float64 bounds) come again later
        warnings.simplefilter("ignore")
        envs = make_envpool(env_id, 1, 0, kwargs)
    try:
        return envs.single_observation_space, envs.single_action_space
    finally:
        envs.close()


def envpool_step_limit(env_id: str, kwargs: dict) -> int | None:
    """The episode step limit EnvPool applies (env.kwargs' max_episode_steps, else the id's default)."""
    limit = kwargs.get("max_episode_steps")
    if limit is None:
        limit = getattr(check_envpool_id(env_id).make_spec(env_id).config, "max_episode_steps", None)
    return int(limit) if limit else None


class GameEpisodeStatistics(gym.vector.VectorWrapper):
    """info["episode"] = {"r", "l"} and info["_episode"] (the mask of envs whose game ended this step), as gymnasium's
    RecordEpisodeStatistics gives them, counting whole games in the game's own reward (see the module docstring).
    Reset steps (those after an env reported an end) are not counted in lengths."""

    def __init__(self, env: gym.vector.VectorEnv):
        super().__init__(env)
        self.game_returns = np.zeros(self.num_envs, dtype=np.float64)
        self.game_lengths = np.zeros(self.num_envs, dtype=np.int64)
        self.resets_next = np.zeros(self.num_envs, dtype=bool)

    def reset(self, *, seed=None, options=None):
        self.game_returns[:] = 0
        self.game_lengths[:] = 0
        self.resets_next[:] = False
        if seed is not None:  # EnvPool fixes its seeds when made (make_envpool) and only warns about this one
            raise ValueError("EnvPool envs are seeded when made; reset them without a seed")
        return self.env.reset(options=options)

    def step(self, actions):
        obs, reward, terminated, truncated, info = self.env.step(actions)
        counted = ~self.resets_next
        game_reward = info.get("reward", reward)  # Atari's unclipped reward under reward_clip
        self.game_returns += np.where(counted, game_reward, 0.0)
        self.game_lengths += counted
        game_over = truncated | (info["terminated"].astype(bool) if "terminated" in info else terminated)
        if game_over.any():
            info["episode"] = {
                "r": np.where(game_over, self.game_returns, 0.0),
                "l": np.where(game_over, self.game_lengths, 0),
            }
            info["_episode"] = game_over
            self.game_returns[game_over] = 0
            self.game_lengths[game_over] = 0
        self.resets_next = terminated | truncated
        return obs, reward, terminated, truncated, info
