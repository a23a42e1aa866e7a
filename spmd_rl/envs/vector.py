"""Gymnasium environments: probe an id up front, then build a rank's vectorized envs (gymnasium's vector envs, or
EnvPool's with env.backend=envpool: envs/envpool_backend.py).

Vector envs run in gymnasium's default NEXT_STEP autoreset mode: the step that ends an episode returns the
episode's final observation, and the following step resets that env (its action is ignored). The env runner marks
such reset steps invalid, and GAE bootstraps truncated episodes from the final observation's value.
"""

from __future__ import annotations

import importlib
import os
import sys
import warnings
from dataclasses import dataclass

import gymnasium as gym
import numpy as np
from gymnasium.wrappers import vector as vector_wrappers

from spmd_rl.config.excerpts import MESSAGE_CHARS, clip, excerpt
from spmd_rl.config.plugins import MODULE_NAME, import_failure
from spmd_rl.config.sections import EnvSection
from spmd_rl.envs.envpool_backend import GameEpisodeStatistics, make_envpool, probe_envpool
from spmd_rl.envs.factory import register_factory
from spmd_rl.runtime.errors import UserError


@dataclass(frozen=True)
class EnvSpec:
    """What every rank must know about the env, without stepping it: the spaces of ONE env."""

    id: str
    observation_space: gym.Space
    action_space: gym.Space
    vectorization: str = "sync"  # the resolved env.vectorization


def probe_env(cfg: EnvSection) -> EnvSpec:
    """Make one env to learn its spaces; a missing id or a failing import is a UserError naming the env.
    With env.groups, one env of every group: their spaces must agree (the policy acts on all of them)."""
    if cfg.groups:
        return _probe_groups(cfg)
    if cfg.backend == "envpool":
        if cfg.vectorization != "auto":
            raise UserError(
                f"env.vectorization={cfg.vectorization} applies to env.backend=gymnasium; EnvPool vectorizes in C++ "
                f"(its threads: env.kwargs.num_threads): leave env.vectorization at auto"
            )
        observation_space, action_space = probe_envpool(cfg.id, cfg.kwargs)
        return EnvSpec(cfg.id, observation_space, action_space, "envpool")
    _import_path_for_user_envs()
    env_id = clip(cfg.id)
    module, colon, name = cfg.id.partition(":")
    if colon and not (MODULE_NAME.fullmatch(module) and name):
        raise UserError(
            f"env.id '{env_id}' must be a registered id (e.g. CartPole-v1) or 'package.module:EnvId-v0', with a "
            f"module name and an id on either side of the ':'"
        )
    if colon:  # imported here, so that anything its import raises is said as such (gym.make would only pass it on)
        try:
            importlib.import_module(module)
        except (Exception, SystemExit, KeyboardInterrupt) as exc:
            raise UserError(
                f"env.id '{env_id}': importing its module failed (module '{module}'): {import_failure(exc)}"
            ) from None
        register_factory(module, name)  # 'module:make_env': a function returning an Env (envs/factory.py)
    try:
        # gymnasium's own warnings appear again when the envs are built; here they would only bury our verdict.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            env = gym.make(cfg.id, **cfg.kwargs)
        registered = gym.spec(_registered_id(cfg.id))  # also rejects ids gym.make only warns about (no version)
    except gym.error.Error as exc:
        raise UserError(f"env.id '{env_id}' cannot be made: {clip(str(exc), MESSAGE_CHARS)}") from None
    except ImportError as exc:
        raise UserError(f"env.id '{env_id}': importing its module failed: {clip(str(exc), MESSAGE_CHARS)}") from None
    except TypeError as exc:
        raise UserError(
            f"env.id '{env_id}' rejected env.kwargs {excerpt(cfg.kwargs)}: {clip(str(exc), MESSAGE_CHARS)}"
        ) from None
    except (SystemExit, KeyboardInterrupt) as exc:  # sys.exit() in a registered env's module or constructor
        raise UserError(f"env.id '{env_id}': making it failed: {import_failure(exc)}") from None
    try:
        mode = cfg.vectorization
        if mode == "auto":
            mode = "vector_entry_point" if registered.vector_entry_point else "sync"
        elif mode == "vector_entry_point" and not registered.vector_entry_point:
            raise UserError(
                f"env.vectorization=vector_entry_point: env.id '{cfg.id}' has no vectorized "
                f"implementation; use env.vectorization=auto, sync or async"
            )
        return EnvSpec(cfg.id, env.observation_space, env.action_space, mode)
    finally:
        env.close()


def _probe_groups(cfg: EnvSection) -> EnvSpec:
    specs = []
    for name, section in cfg.group_sections():
        try:
            spec = probe_env(section)
        except UserError as exc:
            raise UserError(f"env group '{name}': {exc}") from None
        specs.append((name, spec))
    (first, spec), others = specs[0], specs[1:]
    for name, other in others:
        differing = _differing_space(spec, other)
        if differing:
            what, mine, theirs = differing
            raise UserError(
                f"env groups '{first}' and '{name}' differ in their {what}: {mine} vs {theirs}; one policy acts on "
                f"every group, so their spaces must be equal"
            )
    # Several settings in one vector env: plain single envs side by side (an env's own vectorized implementation
    # runs one setting).
    mode = "async" if cfg.vectorization == "async" else "sync"
    return EnvSpec(cfg.id, spec.observation_space, spec.action_space, mode)


def check_same_spaces(spec: EnvSpec, other: EnvSpec, what: str) -> None:
    """`what` (e.g. eval.env) must give the spaces the policy was built for."""
    differing = _differing_space(spec, other)
    if differing:
        name, mine, theirs = differing
        raise UserError(
            f"{what} gives another {name} than env: {theirs} vs {mine}; the policy acts on env's spaces, so change "
            f"{what} to keep them"
        )


def _differing_space(spec: EnvSpec, other: EnvSpec) -> tuple[str, str, str] | None:
    """(which space, spec's, other's), each said briefly, for the first space that differs; None if both agree."""
    for name in ("observation_space", "action_space"):
        if getattr(other, name) != getattr(spec, name):
            return name.replace("_", " "), clip(str(getattr(spec, name))), clip(str(getattr(other, name)))
    return None


def make_vector_env(
    cfg: EnvSection, spec: EnvSpec, seed: int, wrappers: list | None = None
) -> tuple[gym.vector.VectorEnv, int]:
    """This rank's envs with episode statistics (and action clipping / reward scaling where asked).
    `wrappers` wrap each single env (sync or async vectorization only; evaluate's video recorder).
    With env.groups: every group's envs in the groups' order (group_of_envs says which env is whose).

    Returns the vector env and its first observation batch.
    """
    if cfg.backend == "envpool":
        return _make_envpool_vector_env(cfg, seed, wrappers)
    mode = spec.vectorization
    try:
        if cfg.groups:
            envs = _make_group_vector_env(cfg, mode, wrappers)
        else:
            envs = gym.make_vec(cfg.id, num_envs=cfg.num_envs, vectorization_mode=mode, wrappers=wrappers, **cfg.kwargs)
    except gym.error.Error as exc:
        raise UserError(
            f"env.id '{clip(cfg.id)}' cannot be vectorized with env.vectorization={mode}: "
            f"{clip(str(exc), MESSAGE_CHARS)}"
        ) from None
    return _finish(vector_wrappers.RecordEpisodeStatistics(envs), cfg, seed, reset_seed=seed)


def _make_group_vector_env(cfg: EnvSection, mode: str, wrappers: list | None) -> gym.vector.VectorEnv:
    """The groups' envs side by side, each made as gymnasium.make_vec makes one (gym.make, then `wrappers`)."""

    def maker(section: EnvSection):
        def make():
            env = gym.make(section.id, **section.kwargs)
            for wrapper in wrappers or ():
                env = wrapper(env)
            return env

        return make

    env_fns = [maker(section) for _, section in cfg.group_sections() for _ in range(section.num_envs)]
    vector_env = gym.vector.AsyncVectorEnv if mode == "async" else gym.vector.SyncVectorEnv
    return vector_env(env_fns)


def group_of_envs(cfg: EnvSection) -> np.ndarray:
    """The group index of each of an env rank's envs (all 0 without env.groups): int64 [env.num_envs]."""
    if not cfg.groups:
        return np.zeros(cfg.num_envs, dtype=np.int64)
    return np.repeat(np.arange(len(cfg.groups)), [group.num_envs for group in cfg.groups])


def _make_envpool_vector_env(cfg: EnvSection, seed: int, wrappers: list | None):
    if wrappers:
        raise UserError(
            f"env.backend=envpool: env '{clip(cfg.id)}' takes no per-env gymnasium wrappers (a video, a step limit "
            f"of its own); use env.backend=gymnasium for that, or EnvPool's own env.kwargs (max_episode_steps)"
        )
    envs = GameEpisodeStatistics(make_envpool(cfg.id, cfg.num_envs, seed, cfg.kwargs))
    return _finish(envs, cfg, seed, reset_seed=None)  # its seed is fixed when made


def _finish(envs, cfg: EnvSection, seed: int, reset_seed: int | None):
    """The wrappers both backends share, then the first reset."""
    if isinstance(envs.single_action_space, gym.spaces.Box):
        envs = vector_wrappers.ClipAction(envs)  # the policy's Gaussian samples are unbounded
    if cfg.normalize_reward:
        envs = vector_wrappers.NormalizeReward(envs)
    obs, _ = envs.reset(seed=reset_seed)
    envs.action_space.seed(seed)
    return envs, obs


def _registered_id(env_id: str) -> str:
    return env_id.split(":", 1)[1] if ":" in env_id else env_id


def _import_path_for_user_envs() -> None:
    # 'package.module:EnvId' is imported by gymnasium; let a module in the working directory be found the same way
    # under every launcher (python -m puts the cwd on sys.path, torchrun's workers and mpirun's ranks may not).
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.append(cwd)
