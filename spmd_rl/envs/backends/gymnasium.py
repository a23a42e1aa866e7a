"""The gymnasium backend (`env.backend: gymnasium`, the default): gymnasium's vector envs for a registered id or a
user's `package.module:EnvId`, with env.vectorization (the env's own vectorized implementation, sync or async) and
env.groups (several ids / kwargs side by side in one vector env).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import multiprocessing
import os
import warnings

import gymnasium as gym
from gymnasium.wrappers import vector as vector_wrappers

from spmd_rl.config.excerpts import MESSAGE_CHARS, clip, excerpt
from spmd_rl.config.plugins import MODULE_NAME, import_failure, import_path_for_user_code
from spmd_rl.config.sections import EnvSection
from spmd_rl.envs.backend import EnvBackend, EnvSpec, differing_space, finish_vector_env
from spmd_rl.envs.chunks import ActionChunks, chunked_spec
from spmd_rl.envs.env_workers import leave_stops_to_the_rank, quiet_worker_reports
from spmd_rl.envs.factory import register_factory
from spmd_rl.envs.metaworld_envs import WORKER_START_METHOD as METAWORLD_START_METHOD
from spmd_rl.envs.metaworld_envs import is_metaworld_id
from spmd_rl.envs.metaworld_envs import register as register_metaworld
from spmd_rl.runtime.errors import UserError, describe_exception


class GymnasiumBackend(EnvBackend):
    takes_per_env_settings = True

    def steps_without_the_gil(self, cfg: EnvSection) -> bool:
        return cfg.vectorization == "async"  # AsyncVectorEnv: one worker process per env

    def probe(self, cfg: EnvSection) -> EnvSpec:
        spec = chunked_spec(self._probe_groups(cfg) if cfg.groups else self._probe_spaces(cfg), cfg)
        if (cfg.group_size > 1 or cfg.max_episode_steps) and spec.vectorization not in ("sync", "async"):
            # An env's own vectorized implementation takes no wrapper (TimeLimit) and draws every env's reset from
            # one generator (no seed per env).
            if cfg.vectorization == "vector_entry_point":
                raise UserError(
                    "env.group_size and env.max_episode_steps apply to each env: use env.vectorization=auto, sync or "
                    "async, not vector_entry_point"
                )
            spec = dataclasses.replace(spec, vectorization="sync")
        return spec

    def _probe_spaces(self, cfg: EnvSection) -> EnvSpec:
        """The spaces of one env of one id and kwargs (no groups, no chunks)."""
        import_path_for_user_code()  # 'package.module:EnvId' is imported by gymnasium
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
        # metaworld/<task>: registered here, as the factories above (envs/metaworld_envs.py)
        note = register_metaworld(cfg.id) if is_metaworld_id(cfg.id) else ""
        try:
            # gymnasium's own warnings appear again when the envs are built; here they would only bury our verdict.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                env = gym.make(cfg.id, **cfg.kwargs)
            registered = gym.spec(_registered_id(cfg.id))  # also rejects ids gym.make only warns about (no version)
        except gym.error.Error as exc:
            raise UserError(f"env.id '{env_id}' cannot be made: {clip(str(exc), MESSAGE_CHARS)}") from None
        except ImportError as exc:
            raise UserError(
                f"env.id '{env_id}': importing its module failed: {clip(str(exc), MESSAGE_CHARS)}"
            ) from None
        except TypeError as exc:
            raise UserError(
                f"env.id '{env_id}' rejected env.kwargs {excerpt(cfg.kwargs)}: {clip(str(exc), MESSAGE_CHARS)}"
            ) from None
        except (SystemExit, KeyboardInterrupt) as exc:  # sys.exit() in a registered env's module or constructor
            raise UserError(f"env.id '{env_id}': making it failed: {import_failure(exc)}") from None
        except Exception as exc:  # anything else the env's constructor (or a gymnasium wrapper's check) raised
            given = f" with env.kwargs {excerpt(cfg.kwargs)}" if cfg.kwargs else ""
            raise UserError(
                f"env.id '{env_id}' could not be made{given}: {clip(describe_exception(exc), MESSAGE_CHARS)}; "
                f"fix env.kwargs or the env's constructor"
            ) from None
        try:
            mode = cfg.vectorization
            if mode == "auto":
                mode = "vector_entry_point" if registered.vector_entry_point else "sync"
            elif mode == "vector_entry_point" and not registered.vector_entry_point:
                raise UserError(
                    f"env.vectorization=vector_entry_point: env.id '{cfg.id}' has no vectorized "
                    f"implementation; use env.vectorization=auto, sync or async"
                )
            spec = EnvSpec(cfg.id, env.observation_space, env.action_space, mode, _step_info_keys(env), note=note)
        except BaseException:
            with contextlib.suppress(Exception):  # the verdict on its spaces or steps is the one to tell
                env.close()
            raise
        _close_probe(env, env_id)
        return spec

    def _probe_groups(self, cfg: EnvSection) -> EnvSpec:
        specs = []
        for name, section in cfg.group_sections():
            try:
                spec = self._probe_spaces(section)
            except UserError as exc:
                raise UserError(f"env group '{name}': {exc}") from None
            specs.append((name, spec))
        (first, spec), others = specs[0], specs[1:]
        for name, other in others:
            differing = differing_space(spec, other)
            if differing:
                what, mine, theirs = differing
                raise UserError(
                    f"env groups '{first}' and '{name}' differ in their {what}: {mine} vs {theirs}; one policy acts "
                    f"on every group, so their spaces must be equal"
                )
        # Several settings in one vector env: plain single envs side by side (an env's own vectorized implementation
        # runs one setting).
        mode = "async" if cfg.vectorization == "async" else "sync"
        info_keys = frozenset.intersection(*(spec.step_info_keys for _, spec in specs))  # what every group reports
        return EnvSpec(cfg.id, spec.observation_space, spec.action_space, mode, info_keys, note=spec.note)

    def make(self, cfg: EnvSection, spec: EnvSpec, seed: int, wrappers: list | None = None):
        mode = spec.vectorization
        if cfg.max_episode_steps:  # innermost: a limit on primitive steps, below evaluation's own
            wrappers = [
                functools.partial(gym.wrappers.TimeLimit, max_episode_steps=cfg.max_episode_steps),
                *(wrappers or ()),
            ]
        if spec.action_chunk > 1:  # outermost: each primitive step goes through the other wrappers
            chunks = functools.partial(ActionChunks, chunk=spec.action_chunk, success_key=spec.success_key)
            wrappers = [*(wrappers or ()), chunks]
        # The platform's default start method (None) is passed as gymnasium's own default: nothing changes there.
        context = start_method(cfg) if mode == "async" else None
        if mode == "async":  # the first wrapper a worker runs: from then on stops are its rank's
            quiet_worker_reports()
            wrappers = [functools.partial(leave_stops_to_the_rank, rank_pid=os.getpid()), *(wrappers or ())]
        try:
            if cfg.groups:
                envs = _make_group_vector_env(cfg, mode, wrappers, context)
            else:
                envs = gym.make_vec(
                    cfg.id,
                    num_envs=cfg.num_envs,
                    vectorization_mode=mode,
                    vector_kwargs={"context": context} if context else None,
                    wrappers=wrappers,
                    **cfg.kwargs,
                )
        except gym.error.Error as exc:
            raise UserError(
                f"env.id '{clip(cfg.id)}' cannot be vectorized with env.vectorization={mode}: "
                f"{clip(str(exc), MESSAGE_CHARS)}"
            ) from None
        except (EOFError, ConnectionError) as exc:  # a worker ended before it answered
            if not context or context == "fork":
                raise
            raise UserError(
                f"env.vectorization=async: the env worker processes (started by {context}, env.start_method="
                f"{cfg.start_method}) ended while starting ({describe_exception(exc)}); a worker started by {context} "
                f'imports the main script again, which must start its run under `if __name__ == "__main__":`; '
                f"else set env.vectorization=sync"
            ) from None
        return finish_vector_env(vector_wrappers.RecordEpisodeStatistics(envs), cfg, seed, reset_seed=seed)

    def hang_advice(self, cfg: EnvSection, spec: EnvSpec) -> str:
        if spec.vectorization != "async":
            return ""
        method = start_method(cfg) or multiprocessing.get_start_method(allow_none=True) or _platform_start_method()
        other = "spawn" if method == "fork" else "fork"
        workers = f"{cfg.num_envs} env worker process" + ("" if cfg.num_envs == 1 else "es")
        return (
            f" (in {workers} started by {method}; if they never answer, as forks of a "
            f"process holding a GL context do not, set env.start_method={other} or env.vectorization=sync)"
        )

    def step_limit(self, cfg: EnvSection) -> int | None:
        """env.kwargs' max_episode_steps, else the id's registration's; env.max_episode_steps where it is lower."""
        limit = cfg.kwargs.get("max_episode_steps")
        if limit is None:
            try:
                limit = gym.spec(_registered_id(cfg.id)).max_episode_steps
            except gym.error.Error:
                limit = None
        limits = [int(value) for value in (limit, cfg.max_episode_steps) if value]
        return min(limits) if limits else None

    def limit_steps(self, cfg: EnvSection, spec: EnvSpec, max_steps: int):
        """A TimeLimit of our own on each env (vectorized implementations take no wrappers: plain envs then)."""
        if spec.vectorization not in ("sync", "async"):
            spec = dataclasses.replace(spec, vectorization="sync")
        return cfg, spec, [lambda env: gym.wrappers.TimeLimit(env, max_steps)]

    def record_video(self, cfg: EnvSection, spec: EnvSpec, video_dir: str):
        require_moviepy()
        if not os.environ.get("DISPLAY"):  # frames to a file, no window: renderers that need no display
            os.environ.setdefault("MUJOCO_GL", "egl")  # MuJoCo's default (glfw) fails without one
            os.environ.setdefault("SDL_VIDEODRIVER", "dummy")  # pygame (classic control): else SDL prints errors
        from gymnasium.wrappers import RecordVideo

        cfg = dataclasses.replace(cfg, num_envs=1, kwargs={**cfg.kwargs, "render_mode": "rgb_array"})
        spec = dataclasses.replace(spec, vectorization="sync")  # RecordVideo wraps a single env
        return cfg, spec, [lambda env: RecordVideo(env, video_dir, episode_trigger=lambda _: True, name_prefix="eval")]

    # The state of the vector envs and wrappers gymnasium provides (envs/gymnasium_state.py; imported here, as it
    # needs torch).

    def capture_state(self, envs) -> dict | None:
        from spmd_rl.envs.gymnasium_state import capture_env_state

        return capture_env_state(envs)

    def restore_state(self, envs, state: dict) -> None:
        from spmd_rl.envs.gymnasium_state import restore_env_state

        restore_env_state(envs, state)

    def unsaved_reason(self, envs) -> str | None:
        from spmd_rl.envs.gymnasium_state import unsaved_env_reason

        return unsaved_env_reason(envs)


def _step_info_keys(env: gym.Env) -> frozenset:
    """The keys of the info of one step (a reset, then a sampled action, both seeded) of the probe's env. An env
    that fails there reports none: training meets the same failure and says it in its own words."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the env checker's, said again when the envs are built
            env.reset(seed=0)
            env.action_space.seed(0)
            info = env.step(env.action_space.sample())[-1]
    except Exception:
        return frozenset()
    return frozenset(key for key in info if isinstance(key, str)) if isinstance(info, dict) else frozenset()


def start_method(cfg: EnvSection) -> str | None:
    """How async workers start: env.start_method, or with auto the start method an env needs (MetaWorld's: its
    parent, which made one env to read its spaces, holds a GL context whose renderer threads a fork does not carry,
    and forked workers wait for them forever), else None: the platform's default (fork on Linux), as before."""
    if cfg.start_method != "auto":
        return cfg.start_method
    ids = [section.id for _, section in cfg.group_sections()] if cfg.groups else [cfg.id]
    return METAWORLD_START_METHOD if any(is_metaworld_id(env_id) for env_id in ids) else None


def _make_group_vector_env(
    cfg: EnvSection, mode: str, wrappers: list | None, context: str | None
) -> gym.vector.VectorEnv:
    """The groups' envs side by side, each made as gymnasium.make_vec makes one (gym.make of the registered spec,
    which a spawned worker, whose registry lacks the ids registered at run time, can make too; then `wrappers`)."""

    def maker(section: EnvSection):
        registered = gym.spec(_registered_id(section.id))

        def make():
            env = gym.make(registered, **section.kwargs)
            for wrapper in wrappers or ():
                env = wrapper(env)
            return env

        return make

    env_fns = [maker(section) for _, section in cfg.group_sections() for _ in range(section.num_envs)]
    if mode == "async":
        return gym.vector.AsyncVectorEnv(env_fns, context=context)
    return gym.vector.SyncVectorEnv(env_fns)


def _platform_start_method() -> str:
    """The start method multiprocessing uses when none was set, read without fixing it (get_start_method would)."""
    return multiprocessing.get_all_start_methods()[0]


def _close_probe(env: gym.Env, env_id: str) -> None:
    """Close the env that read the spaces; its close() is user code and may raise (or call sys.exit)."""
    try:
        env.close()
    except (Exception, SystemExit) as exc:
        raise UserError(
            f"env.id '{env_id}': its close() failed when the checks before start closed the env that read its "
            f"spaces: {clip(describe_exception(exc), MESSAGE_CHARS)}; fix the env's close()"
        ) from None


def _registered_id(env_id: str) -> str:
    return env_id.split(":", 1)[1] if ":" in env_id else env_id


def require_moviepy() -> None:
    try:
        import moviepy  # noqa: F401  (gymnasium's RecordVideo writes the files with it)
    except ImportError:
        raise UserError('--video needs moviepy: pip install -e ".[video]"') from None
