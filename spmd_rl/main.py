"""The program every rank runs: `python -m spmd_rl.main [--config FILE] [--dry-run] [section.key=value ...]`.

Everything a user can get wrong is checked before any process group exists (config, the classes it names, layout,
env id, spaces, the policy's declared outputs against what it returns), so bad input ends every rank with exit
code 2 and one line, never a hang or a traceback. torch is imported only after the config is read, so `--help` and
config errors answer at once.

Exit codes: 0 done, 2 user error (config, files, plug-in contract), 3 communication error, 4 an error in the
user's code (env, policy, algorithm, callback) or bad data from it, 75 stopped with a checkpoint (rerun to resume),
128 + N stopped by signal N.

In Python (a notebook, a script), `spmd_rl.train(config, overrides)` runs the same program in this one process and
returns the run (see `train` below).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from spmd_rl.config.excerpts import excerpt
from spmd_rl.config.loading import OneConfig, describe_schema, load_config
from spmd_rl.config.sections import DistSection
from spmd_rl.run.topology import build_topology
from spmd_rl.runtime.errors import USER_CODE_EXIT_CODE, StopSignal, UserError
from spmd_rl.runtime.exits import (
    QUIET_RANK_LINGER_S,
    end_process,
    leave_exit_code,
    quiet_torch_cpp_warnings,
    user_error,
    write_whole_lines,
)
from spmd_rl.runtime.launch import detect_launch, rank_from_env
from spmd_rl.runtime.orphans import watch_for_orphaning
from spmd_rl.runtime.postmortem import begin_attempt
from spmd_rl.runtime.signals import (
    SIGINT_IGNORED_NOTE,
    STOP_SIGNALS,
    install_early_signal_handlers,
    install_signal_handlers,
    outlive_terminal_hangup,
    sigint_ignored,
    stop_cause,
)
from spmd_rl.runtime.user_exits import guard_os_exit
from spmd_rl.runtime.watchdog import COLLECTIVE_MARGIN_S, watchdog

USAGE_EXAMPLES = """\
examples:
  python -m spmd_rl.main                                    # PPO on CartPole-v1 in one process
  python -m spmd_rl.main --config configs/ppo_pendulum.yaml train.total_steps=200000
  torchrun --standalone --nproc_per_node=8 -m spmd_rl.main --config configs/ppo_cartpole_split.yaml
  python -m spmd_rl.main --config my.yaml policy.class=my_pkg.nets:MyPolicy --dry-run

config sections and keys (override any with section.key=value); the algo, policy, engine and callbacks sections
list the keys of the classes this config selects:
"""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m spmd_rl.main",
        add_help=False,
        description="Train a policy with spmd_rl. Every rank runs this same program (torchrun, mpirun, srun, or "
        "one process).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "-h",
        "--help",
        action="store_true",
        help="show this help (with the keys of the classes the given config selects) and exit",
    )
    parser.add_argument(
        "--config",
        metavar="FILE",
        action=OneConfig,
        help="YAML config (default: the embedded PPO CartPole-v1 config, the same as configs/ppo_cartpole.yaml)",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="run one real iteration in the real layout (every "
        "role, every channel, one weight sync) in a temporary run directory, then exit 0",
    )
    parser.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides")
    # overrides before and after an option (`key=v --config F key2=v`): parse_args took the later ones for
    # unrecognized arguments, naming a valid key (fault pass 9, CLI1)
    args = parser.parse_intermixed_args(argv)
    args.format_help = parser.format_help
    return args


def main(argv: list[str] | None = None) -> int:
    quiet_torch_cpp_warnings()  # before torch loads (after the config is read): one line per failure, no C++ stack
    # Before anything slow (torch's import takes seconds): a signal from here on is a line and a defined code.
    install_early_signal_handlers(on_quiet_stop=_stop_heard_by_rank_0)
    outlive_terminal_hangup()  # a line printed after the terminal hung up is dropped, not an OSError (exit 1)
    write_whole_lines(sys.stdout, sys.stderr)  # ranks share a terminal: one write per line, never two glued
    if sigint_ignored() and rank_from_env() in (None, 0):  # said once, at once: a Ctrl-C later would do nothing
        print(SIGINT_IGNORED_NOTE.format(pid=os.getpid()), flush=True)
    guard_os_exit()  # before the first plug-in import: os._exit in user code is exit 4 and a line, never a success
    # User code runs from the first plug-in import on (while the config is read, --help included): bounded by
    # dist.timeout_s's default until the config gives its own.
    rank = rank_from_env()
    begin_attempt()  # this torchrun attempt's record directory, so that the scripts summarize this attempt's records
    if rank in (None, 0):
        leave_exit_code(None)  # no code yet for this attempt (torchrun may have restarted the ranks)
    # A hang in a plug-in's import (while the config is read) on a rank other than 0 reaches rank 0 too, which would
    # otherwise wait for it dist.timeout_s + 60 s and say only that it did not join (fault pass 8, J3a).
    watchdog.configure(DistSection().timeout_s, f"rank {rank if rank is not None else 0}", _hang_heard_by_rank_0)
    # Under torchrun: a rank whose agent is gone (a kill -9 of the launcher's group) stops instead of training on.
    watch_for_orphaning(lambda: watchdog.timeout_s + COLLECTIVE_MARGIN_S, lambda: watchdog.who)
    try:
        code = _main(argv)
    except (StopSignal, KeyboardInterrupt) as stop:  # before the run began: nothing to save, nothing to resume
        name, code = (
            ("SIGINT", 130) if isinstance(stop, KeyboardInterrupt) else (stop.signal_name, 128 + stop.signal_number)
        )
        # Rank 0 speaks for the job: a launcher that saw another rank fail signals the rest, which end quietly.
        if rank_from_env() in (None, 0):
            line = f"spmd_rl: stopped by {name}{stop_cause()} while starting, before the run began"
            print(line, file=sys.stderr, flush=True)
        else:
            _stop_heard_by_rank_0(code, f"spmd_rl: rank {rank}: stopped by {name} while starting, before the run began")
    if rank_from_env() in (None, 0):
        # also for what ends before the run starts (a config or layout error, a signal): torchrun exits 1 whatever
        # its ranks did, and launch/torchrun.sh reads the job's code from here
        leave_exit_code(code)
    return code


def _stop_heard_by_rank_0(code: int, line: str) -> None:
    """Ranks started by hand only (no launcher ends the others when one ends): a rank other than 0 stopped by a
    signal before the process group formed leaves its code and line for rank 0, which prints the line and ends the
    job with that code; it waited dist.timeout_s + 60 s for this rank and said it did not join (fault pass 8, H2).
    Quiet when rank 0 does not hear it within 10 s (it stopped too, or is gone: it spoke for itself). A second stop
    signal meanwhile ends this rank at once."""
    for number in STOP_SIGNALS:
        signal.signal(number, lambda *_: os._exit(code))
    try:
        launch = detect_launch()
        if launch.launcher == "env":
            from spmd_rl.runtime.meeting import tell_rank_0

            tell_rank_0(launch, code, line, spoke=False, timeout_s=min(watchdog.timeout_s, QUIET_RANK_LINGER_S))
    except Exception:  # noqa: BLE001 - this rank is ending either way; rank 0's own bound still holds
        pass


def _hang_heard_by_rank_0() -> None:
    """The watchdog's last act on a rank whose plug-in import hung: its code for rank 0 (the rank's own line is
    printed already)."""
    launch = detect_launch()
    from spmd_rl.runtime.meeting import tell_rank_0

    tell_rank_0(launch, USER_CODE_EXIT_CODE, "", spoke=True, timeout_s=watchdog.timeout_s)


def _main(argv: list[str] | None) -> int:
    args = parse_args(argv)
    # Everything a user can get wrong, checked before any process group exists. The config and the layout are
    # the same on every rank, so rank 0 speaks for all; the env (its packages, its files) belongs to a host, so
    # the first rank of every host speaks for it.
    try:
        cfg = load_config(args.config, args.overrides)
    except UserError as exc:  # before the launch is known: the launcher's rank variable says who is rank 0
        return user_error(exc, speaker=rank_from_env() in (None, 0))
    if args.help:
        print(args.format_help() + "\n" + USAGE_EXAMPLES + describe_schema(cfg))
        return 0
    try:
        launch = detect_launch()
    except UserError as exc:
        return user_error(exc, speaker=True)
    try:  # the layout needs only the world size: checked before torch's seconds-long import on every rank
        build_topology(cfg.layout, launch.world_size)
    except UserError as exc:
        return user_error(exc, speaker=launch.rank == 0)

    # Imported only now: torch, tensordict and the envs take seconds, and --help and config errors answer without.
    from spmd_rl.runtime.fast_imports import import_tensordict_without_dynamo, optimizers_without_dynamo

    import_tensordict_without_dynamo()
    optimizers_without_dynamo()
    from spmd_rl.run.driver import train

    install_signal_handlers()  # the imports are done: a signal that came meanwhile is raised here
    return train(cfg, launch, dry_run=args.dry_run)


# -- the Python API -----------------------------------------------------------------------------------------------


@dataclass
class TrainedRun:
    """What `train` returns: the run directory, whether the run finished, its last metrics.jsonl record, the
    trained policy and the run's config."""

    dir: Path  # the run directory (config.yaml, metrics.jsonl, policy.pt, checkpoints/)
    finished: bool  # False: stopped with a checkpoint (run.stop_after_iterations, a signal); train again to resume
    metrics: dict  # the last record of metrics.jsonl (its keys: docs/running.md, "What a run writes")
    policy: Any  # the trained Policy, loaded as spmd_rl.load_policy does (eval mode; act takes numpy or torch)
    cfg: Any  # the run's Config, as saved in config.yaml
    stop: str = ""  # the stop line when it stopped ("stopped by ... after iteration N; checkpoint ...")


def train(config: str | Path | Mapping | None = None, overrides: Mapping[str, Any] | Iterable[str] = ()) -> TrainedRun:
    """Train in this process, as `python -m spmd_rl.main` does in one process, and return the run.

    config: a YAML file (as --config), a mapping of sections as such a file holds ({"algo": {"class": "sac"},
        "env": {"id": "Pendulum-v1"}}), or None for the defaults (PPO on CartPole-v1).
    overrides: {"train.total_steps": 20000, "policy.hidden_sizes": [32, 32]}, or ["train.total_steps=20000"] as on
        the command line; they win over the mapping's keys.

    The same checks, layout (it must fit one process: colocated), files and resume as the command line: with the same
    run.dir, a stopped run resumes (run.stop_after_iterations trains in chunks). Errors raise: UserError for bad
    input (config, files, the plug-in contract), UserCodeError or the user's own exception for an error in user code;
    nothing calls sys.exit. Torch's thread count, the signal handlers and the stop state are restored afterwards;
    the run seeds torch's, numpy's and Python's generators as the command line does."""
    # Imported only now: torch, tensordict and the envs take seconds.
    from spmd_rl.persist.run_files import METRICS_FILE
    from spmd_rl.run.driver import train_in_process
    from spmd_rl.run.metrics import last_record
    from spmd_rl.run.policies import load_policy

    cfg = load_config(*_config_and_overrides(config, overrides))
    outcome = train_in_process(cfg)
    policy, run_cfg = load_policy(outcome.run_dir)
    return TrainedRun(
        dir=outcome.run_dir,
        finished=outcome.stopped is None,
        metrics=last_record(outcome.run_dir / METRICS_FILE),
        policy=policy,
        cfg=run_cfg,
        stop=str(outcome.stopped or ""),
    )


def _config_and_overrides(config, overrides) -> tuple[str | Path | None, list[str]]:
    """(a config file or None, the overrides as command-line items)."""
    if isinstance(overrides, (str, bytes)):
        raise UserError(f"overrides {overrides!r}: give a mapping {{'section.key': value}} or a list of 'key=value'")
    items = (
        {key: _yaml_text(key, value) for key, value in overrides.items()}
        if isinstance(overrides, Mapping)
        else dict(_split_item(item) for item in overrides)
    )
    if isinstance(config, Mapping):  # its keys as overrides, under the given ones
        items = {**{key: _yaml_text(key, value) for key, value in _flatten(config)}, **items}
        config = None
    elif config is not None and not isinstance(config, (str, Path)):
        raise UserError(f"config {config!r}: give a YAML file's path, a mapping of sections, or None (the defaults)")
    return config, [f"{key}={text}" for key, text in items.items()]


def _split_item(item) -> tuple[str, str]:
    if not isinstance(item, str) or "=" not in item:
        raise UserError(f"override {item!r} must look like 'section.key=value' (e.g. 'train.total_steps=50000')")
    key, _, text = item.partition("=")
    return key, text


def _flatten(mapping: Mapping, prefix: str = ""):
    """('section.key', value) for every leaf of nested mappings (lists and scalars are leaves)."""
    for key, value in mapping.items():
        if isinstance(value, Mapping) and value:
            yield from _flatten(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def _yaml_text(key: str, value) -> str:
    """A Python value as an override's text: strings as given (as on the command line), the rest as YAML; an object
    a config cannot hold (an env, a function: every rank and config.yaml need it by name) is a UserError saying
    what to give instead."""
    if isinstance(value, str):
        return value
    if hasattr(value, "step") and hasattr(value, "reset") or callable(value):
        what = "a gymnasium Env object" if hasattr(value, "step") else f"a callable ({getattr(value, '__name__', '?')})"
        instead = (
            "give a registered id such as 'CartPole-v1', or name your factory, 'my_module:make_env' (a function "
            "returning a gymnasium Env, importable on every rank; env.kwargs are its keyword arguments)"
            if key.split(".")[-1] == "id"
            else "give its name, 'my_module:Name', importable on every rank"
        )
        raise UserError(
            f"{key}: got {what}, but a config holds names, not objects (every rank builds its own, and config.yaml "
            f"records the run); {instead}"
        )
    try:
        text = yaml.safe_dump(_plain(value), default_flow_style=True, width=1 << 30).strip()
    except yaml.representer.RepresenterError:
        raise UserError(
            f"{key}: {type(value).__name__} {excerpt(value)} is not a config value: give a number, a string, a bool, "
            f"a list or a mapping of those"
        ) from None
    return text.removesuffix("...").strip()  # a scalar's document end marker


def _plain(value):
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):  # a numpy or torch scalar
        return value.item()
    return value


if __name__ == "__main__":
    end_process(main())
