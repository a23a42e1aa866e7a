"""Demonstrations to HDF5: `python -m spmd_rl.collect --config C [--episodes N] [--out FILE] [--success-only]
[--policy RUN_DIR|CHECKPOINT] [--stochastic] [section.key=value ...]`.

Plays whole episodes on one env of the config's `env` section (its id, kwargs, env.action_chunk K,
env.max_episode_steps, env.tokenizer) and appends each to an spmd_rl experience file (storage/writer.py: chunked,
fletcher32-checked, crash-safe), one row per decision: the observation as the policy sees it (image, state,
instruction token ids), the K actions taken from it, their rewards, and the episode's outcome. Who acts: the env's
scripted expert (MetaWorld's `metaworld.policies`, closed loop at every primitive step), or `--policy`, a trained
policy (its chunk run open loop, as in training).

Episode attempt a starts from reset seed train.seed + a (a MetaWorld env's task configuration (seed) mod 50), and a
stochastic policy samples from torch seed train.seed + a, so a file is the same however often its collection was
interrupted. Rerunning the command continues the file (the episodes it holds are kept; rows of an episode that a
crash cut short are dropped); a file collected with other settings is refused. `--success-only` writes only the
episodes that succeeded. The file layout is in docs/storage-and-resume.md ("Demonstration files").

A stop signal (SIGTERM, SIGINT, SIGHUP, SIGUSR1) ends the collection after the episode being played, with one line
saying what the file holds, exit 75; a second signal ends it at once (the episode in play is dropped, as after a
crash). Rerunning the command continues the file.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import sys
from pathlib import Path

import gymnasium as gym
import numpy as np

from spmd_rl.config.excerpts import clip
from spmd_rl.config.loading import OneConfig, load_config
from spmd_rl.config.sections import Config, EnvSection
from spmd_rl.envs.metaworld_envs import is_metaworld_id, scripted_expert
from spmd_rl.envs.vector import EnvSpec, check_same_spaces, make_vector_env, probe_env
from spmd_rl.persist.fileio import open_regular
from spmd_rl.runtime.errors import STOPPED_EXIT_CODE, USER_ERROR_EXIT_CODE, StopSignal, UserError
from spmd_rl.runtime.signals import STOP_SIGNALS
from spmd_rl.storage.reader import HDF5Reader
from spmd_rl.storage.writer import HDF5Writer

COLLECT_ATTRIBUTE = "collect"  # the file's attribute: JSON of the settings its episodes were collected with
ATTEMPTS_PER_EPISODE = 20  # --success-only gives up after this many attempts per episode asked for


class _Stop:
    asked: str | None = None  # the name of the stop signal the command line's collection was sent


def _ask_stop(signum: int, frame) -> None:
    name = signal.Signals(signum).name
    if _Stop.asked is not None:  # a second signal: at once (the episode in play is not written)
        raise StopSignal(name, signum)
    _Stop.asked = name


def collect(
    cfg: Config,
    out: Path,
    episodes: int,
    success_only: bool = False,
    policy_path: Path | None = None,
    deterministic: bool = True,
) -> dict:
    """Collect until `out` holds `episodes` episodes, or a stop signal came (main's handlers); returns {"episodes",
    "rows", "attempts", "successes"} of this call and "held", the episodes `out` holds. Bad input (an env without an
    expert and no policy, a policy for other spaces, a file of other settings) is a UserError."""
    env_cfg = single_env_section(cfg.env)
    spec = probe_env(env_cfg)
    if spec.note:
        print(f"spmd_rl.collect: note: {spec.note}", flush=True)
    chunk = cfg.env.action_chunk
    actor = _actor(cfg, spec, policy_path, deterministic)
    settings = {
        "env": cfg.env.id,
        "kwargs": cfg.env.kwargs,
        "action_chunk": chunk,
        "max_episode_steps": cfg.env.max_episode_steps,
        "seed": cfg.train.seed,
        "actor": actor.name,
        "success_only": success_only,
    }
    layout = demonstration_layout(spec.observation_space, spec.action_space, chunk)
    kept, next_attempt = _resume_point(out, settings)
    writer = HDF5Writer(out, layout, attributes={COLLECT_ATTRIBUTE: json.dumps(settings, sort_keys=True)})
    envs = None
    done = {"episodes": 0, "rows": 0, "attempts": 0, "successes": 0, "held": kept.episodes}
    try:
        writer.rewind(kept.rows)  # rows of an episode a crash cut short (appends are whole episodes)
        envs, _ = make_vector_env(env_cfg, spec, cfg.train.seed)
        first, attempt = kept.episodes, next_attempt
        while kept.episodes < episodes and _Stop.asked is None:
            if success_only and done["attempts"] >= ATTEMPTS_PER_EPISODE * (episodes - first):
                raise UserError(
                    f"--success-only: {done['successes']} of {done['attempts']} attempts succeeded, too few for "
                    f"{episodes - first} episodes ({kept.episodes} in {out}); collect without --success-only"
                )
            rows, success = _play_episode(envs, actor, cfg.train.seed + attempt, chunk, layout, spec.action_space)
            done["attempts"] += 1
            done["successes"] += int(success)
            if success or not success_only:
                rows["episode"][:] = kept.episodes
                rows["episode_seed"][:] = cfg.train.seed + attempt
                steps = rows.pop("steps")
                writer.append(rows, env_id=0, env_step=kept.env_steps + np.cumsum(steps) - steps)
                kept = kept.plus(len(steps), int(steps.sum()))
                done["episodes"] += 1
                done["rows"] += len(steps)
                done["held"] = kept.episodes
            attempt += 1
    finally:
        writer.close()
        if envs is not None:
            envs.close()
    return done


def single_env_section(env: EnvSection) -> EnvSection:
    """The config's env as one plain env: collect plays one episode at a time and splits chunks itself (the expert
    acts at every primitive step)."""
    if env.groups:
        raise UserError("spmd_rl.collect plays one env: give env.id without env.groups")
    return dataclasses.replace(env, num_envs=1, total_envs=0, action_chunk=1, group_size=1)


def demonstration_layout(observation_space: gym.Space, action_space: gym.Space, chunk: int) -> dict:
    """{path: (shape, dtype)} of one row (one decision): docs/storage-and-resume.md lists the keys."""
    layout = {_obs_path(key): field for key, field in _space_fields(observation_space).items()}
    if not isinstance(action_space, gym.spaces.Box):
        raise UserError(f"spmd_rl.collect records Box actions; this env's is {clip(str(action_space))}")
    per_chunk = (chunk,) if chunk > 1 else ()
    layout["action"] = ((*per_chunk, *action_space.shape), np.dtype(np.float32))
    layout["reward"] = (per_chunk, np.dtype(np.float32))
    if chunk > 1:
        layout["chunk_valid"] = (per_chunk, np.dtype(np.bool_))
    # valid: every row is a decision (the experience log's step field, which bc reads to leave reset steps out).
    for key in ("valid", "terminated", "truncated", "success", "episode_success"):
        layout[key] = ((), np.dtype(np.bool_))
    layout["episode"] = ((), np.dtype(np.int64))
    layout["episode_seed"] = ((), np.dtype(np.int64))
    return layout


def _space_fields(space: gym.Space) -> dict:
    if isinstance(space, gym.spaces.Dict):
        return {
            f"{key}/{path}" if path else key: field
            for key, sub in space.spaces.items()
            for path, field in _space_fields(sub).items()
        }
    if isinstance(space, gym.spaces.Box):
        return {"": (tuple(space.shape), np.dtype(space.dtype))}
    if isinstance(space, gym.spaces.Discrete):
        return {"": ((), np.dtype(np.int64))}
    raise UserError(f"spmd_rl.collect records Box, Discrete and Dict observations, not {clip(str(space))}")


@dataclasses.dataclass(frozen=True)
class _Kept:
    """What the file already holds: whole episodes, their rows and primitive steps."""

    episodes: int = 0
    rows: int = 0
    env_steps: int = 0

    def plus(self, rows: int, env_steps: int) -> _Kept:
        return _Kept(self.episodes + 1, self.rows + rows, self.env_steps + env_steps)


def _resume_point(out: Path, settings: dict) -> tuple[_Kept, int]:
    """(what `out` holds in whole episodes, the next attempt) for a file collected with `settings`; (nothing, 0)
    for a new file."""
    if not out.exists():
        return _Kept(), 0
    try:  # HDF5's open of a FIFO waited for a writer forever, deaf to SIGTERM (fault pass 5, R5)
        open_regular(out).close()
    except OSError as exc:
        raise UserError(f"{exc}: give --out a file of its own (it is made when absent)") from None
    with HDF5Reader(out) as reader:
        given = reader.attrs.get(COLLECT_ATTRIBUTE)
        if given is None or json.loads(given) != settings:
            raise UserError(
                f"{out} holds other episodes than these settings collect ({clip(str(given), 300)}): give another "
                f"--out, or the settings it was collected with"
            )
        rows = len(reader)
        if not rows:
            return _Kept(), 0
        columns = reader.read(0, rows, meta=True)
    ended = np.flatnonzero(columns["terminated"] | columns["truncated"])
    if not len(ended):
        return _Kept(), 0
    last = int(ended[-1])
    steps = columns["meta/env_step"][last] - columns["meta/env_step"][0]
    valid = columns["chunk_valid"][last] if "chunk_valid" in columns else np.ones(1, dtype=bool)
    kept = _Kept(int(columns["episode"][last]) + 1, last + 1, int(steps + valid.sum()))
    return kept, int(columns["episode_seed"][last]) - settings["seed"] + 1


class _Actor:
    """Who acts: `begin` at an episode's reset, then `actions(obs, raw)` for the next primitive steps."""

    name: str

    def begin(self, seed: int, info: dict) -> None:
        """An episode starts from reset seed `seed` (info: the reset's)."""

    def actions(self, obs, raw: np.ndarray | None) -> np.ndarray:
        """[n, *action shape] actions for the next n primitive steps, from the observation (a batch of one) and the
        env's own state vector (MetaWorld's)."""
        raise NotImplementedError


class _ScriptedExpert(_Actor):
    """MetaWorld's scripted expert of the episode's task: one action per primitive step, from the full state."""

    name = "scripted expert"

    def begin(self, seed: int, info: dict) -> None:
        self.expert = scripted_expert(str(info["task"][0]))

    def actions(self, obs, raw: np.ndarray | None) -> np.ndarray:
        return self.expert.get_action(raw)[None]


class _TrainedPolicy(_Actor):
    """A trained policy (spmd_rl.evaluate's load_policy): its chunk, run open loop."""

    def __init__(self, path: Path, spec: EnvSpec, chunk: int, deterministic: bool):
        from spmd_rl.run.policies import load_policy

        self.policy, run_cfg = load_policy(path)
        run_spec = probe_env(single_env_section(run_cfg.env))
        check_same_spaces(spec, run_spec, f"the env of {path}")  # observations: what the policy was built for
        if run_cfg.env.action_chunk != chunk:
            raise UserError(
                f"--policy {path} acts in chunks of {run_cfg.env.action_chunk}, the config's env.action_chunk is "
                f"{chunk}: set env.action_chunk={run_cfg.env.action_chunk}"
            )
        self.chunk, self.deterministic = chunk, deterministic
        self.name = f"policy {path}{'' if deterministic else ' (stochastic)'}"

    def begin(self, seed: int, info: dict) -> None:
        import torch

        torch.manual_seed(seed)  # a stochastic policy's episode is the same on every collection

    def actions(self, obs, raw: np.ndarray | None) -> np.ndarray:
        action = np.asarray(self.policy.act(obs, deterministic=self.deterministic)["action"])[0]
        return action.reshape(self.chunk, -1) if self.chunk > 1 else action[None]


def _actor(cfg: Config, spec: EnvSpec, policy_path: Path | None, deterministic: bool) -> _Actor:
    if policy_path is not None:
        return _TrainedPolicy(policy_path, spec, cfg.env.action_chunk, deterministic)
    if not is_metaworld_id(cfg.env.id):
        raise UserError(
            f"env.id '{clip(cfg.env.id)}' has no scripted expert (MetaWorld's metaworld/<task> ids do): give "
            f"--policy RUN_DIR to collect a trained policy's episodes"
        )
    return _ScriptedExpert()


def _play_episode(envs, actor: _Actor, seed: int, chunk: int, layout: dict, action_space) -> tuple[dict, bool]:
    """One episode from reset seed `seed`: its rows (one per decision, plus "steps", the primitive steps each ran)
    and whether it succeeded at any step. Actions are recorded clipped to the env's bounds, as the env applies
    them (the vector env's own space is unbounded under ClipAction)."""
    obs, info = envs.reset(seed=[seed])
    actor.begin(seed, info)
    raw = info["metaworld_observation"][0] if "metaworld_observation" in info else None
    low, high = action_space.low, action_space.high
    rows: dict[str, list] = {key: [] for key in layout}
    rows["steps"] = []
    episode_success, ended = False, False
    while not ended:
        for key, value in _leaves(obs).items():
            rows[_obs_path(key)].append(value[0])
        actions = np.zeros((chunk, *low.shape), dtype=np.float32)
        rewards = np.zeros(chunk, dtype=np.float32)
        ran, success, planned = 0, False, np.empty((0, *low.shape))
        while ran < chunk and not ended:
            if not len(planned):
                planned = actor.actions(obs, raw)
            action, planned = np.clip(planned[0], low, high).astype(np.float32), planned[1:]
            obs, reward, terminated, truncated, info = envs.step(action[None])
            raw = info["metaworld_observation"][0] if "metaworld_observation" in info else None
            actions[ran], rewards[ran] = action, reward[0]
            success |= bool(info.get("success", np.zeros(1, dtype=bool))[0])
            ran += 1
            ended = bool(terminated[0] or truncated[0])
        episode_success |= success
        rows["action"].append(actions if chunk > 1 else actions[0])
        rows["reward"].append(rewards if chunk > 1 else rewards[0])
        if chunk > 1:
            rows["chunk_valid"].append(np.arange(chunk) < ran)
        rows["terminated"].append(ended and bool(terminated[0]))
        rows["truncated"].append(ended and not terminated[0])
        rows["success"].append(success)
        rows["steps"].append(ran)
    decisions = len(rows["steps"])
    rows["episode_success"] = [episode_success] * decisions
    rows["valid"] = [True] * decisions
    rows["episode"] = rows["episode_seed"] = [0] * decisions
    arrays = {
        key: np.asarray(values, dtype=layout[key][1]) if key in layout else np.asarray(values)
        for key, values in rows.items()
    }
    return arrays, episode_success


def _obs_path(key: str) -> str:
    """A row's dataset for an observation leaf: obs/<key> of a Dict space, obs itself for a Box or Discrete one (an
    empty key made the dataset name 'obs/', which HDF5 refuses: fault pass 4, L3)."""
    return f"obs/{key}" if key else "obs"


def _leaves(obs, prefix: str = "") -> dict:
    if isinstance(obs, dict):
        return {path: leaf for key, value in obs.items() for path, leaf in _leaves(value, f"{prefix}{key}/").items()}
    return {prefix.rstrip("/"): obs}


# -- command line ------------------------------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, like every other bad input (argparse's default adds the usage)
        self.exit(USER_ERROR_EXIT_CODE, f"{self.prog}: error: {message} (see --help)\n")


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="python -m spmd_rl.collect", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--config", type=Path, required=True, action=OneConfig, help="a run config: its env section is played"
    )
    parser.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides")
    parser.add_argument("--episodes", type=int, default=50, help="episodes the file holds when done (default 50)")
    parser.add_argument(
        "--out", type=Path, help="the HDF5 file (default demos/<run.name>.h5); an existing one continues"
    )
    parser.add_argument("--success-only", action="store_true", help="write only the episodes that succeeded")
    parser.add_argument(
        "--policy", type=Path, metavar="RUN_DIR|CHECKPOINT", help="a trained policy acts, not the expert"
    )
    parser.add_argument("--stochastic", action="store_true", help="with --policy: sample actions (default: the mode)")
    args = parser.parse_intermixed_args(argv)  # overrides on both sides of an option (fault pass 9, CLI1)
    if args.episodes < 1:
        parser.error(f"--episodes must be at least 1, not {args.episodes}")
    for signum in STOP_SIGNALS:
        if signal.getsignal(signum) is not signal.SIG_IGN:  # `nohup`, a script's background job: left ignored
            signal.signal(signum, _ask_stop)
    out = args.out
    try:
        cfg = load_config(args.config, args.overrides)
        out = args.out or Path("demos") / f"{cfg.run.name}.h5"
        done = collect(cfg, out, args.episodes, args.success_only, args.policy, not args.stochastic)
    except UserError as exc:
        print(f"spmd_rl.collect: error: {exc}", file=sys.stderr, flush=True)
        return USER_ERROR_EXIT_CODE
    except StopSignal as stop:
        print(
            f"spmd_rl.collect: stopped at once by a second {stop.signal_name}: {out or 'the file'} keeps its whole "
            f"episodes (the one in play is dropped); rerun the command to continue it",
            file=sys.stderr,
            flush=True,
        )
        return STOPPED_EXIT_CODE
    if _Stop.asked is not None:
        print(
            f"spmd_rl.collect: stopped by {_Stop.asked}: {out} holds {done['held']} of {args.episodes} episodes; this "
            f"call wrote {done['episodes']}; rerun the command to continue it",
            file=sys.stderr,
            flush=True,
        )
        return STOPPED_EXIT_CODE
    print(
        f"spmd_rl.collect: {out} holds {args.episodes} episodes; this call wrote {done['episodes']} ({done['rows']} "
        f"rows), {done['successes']} of its {done['attempts']} attempts succeeded",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
