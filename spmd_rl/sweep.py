"""Several runs of one config: seeds and a grid of values, one after another or as a Slurm job array.

    python -m spmd_rl.sweep --config FILE train.seed=1,2,3 algo.learning_rate=3e-4,1e-3 [section.key=value ...]

An override whose value holds commas at its top level is a list of values; the sweep runs the cartesian product of
all such lists (the first listed key varies slowest), each combination with the other overrides. Commas inside
brackets, braces or quotes do not split: `policy.hidden_sizes=[64,64],[32,32]` is two values.

Every combination's config is checked (spmd_rl.config.loading.load_config) before any run starts: bad input is
exit 2 and one line. Each run gets its own run directory, named by its values, under one sweep directory
(default runs/sweep-<run.name>-<digest of the combinations' configs>/), which also holds sweep.json (the plan).
Rerunning the same command finds the same sweep directory: finished runs are skipped, stopped ones resume.

Over 400 lines: one command read top to bottom (the grid, running it in this process, running it as a Slurm job
array, the command line), each part short and used by the next.

Sequentially (the default), each run is a `python -m spmd_rl.main` subprocess (or `LAUNCHER -m spmd_rl.main`, e.g.
`--launcher "torchrun --standalone --nproc_per_node=4"`), its stdout and stderr in <run dir>/sweep.log. A failed run
does not stop the others. Exit codes: 0 all done, 1 some failed (one line names them and their logs), 2 bad input,
75 stopped (a signal, or runs stopped by run.stop_after_iterations): rerun the same command to resume.

With --slurm the sweep writes <sweep dir>/sweep.sbatch, an sbatch job array whose task i runs combination i through
slurm/train.sh (or --slurm-script), and submits it; its task entry is `python -m spmd_rl.sweep --task SWEEP_DIR`
(combination $SLURM_ARRAY_TASK_ID).

The curves: `python -m spmd_rl.plot SWEEP_DIR -o curves.png` draws one curve per combination, its seeds as mean and
spread. This module imports no torch: --help and bad input answer at once.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from spmd_rl.config.loading import OneConfig, load_config
from spmd_rl.persist.fileio import file_error, make_dirs
from spmd_rl.persist.run_files import CONFIG_FILE, FINISHED
from spmd_rl.runtime.errors import STOPPED_EXIT_CODE, USER_ERROR_EXIT_CODE, UserError

FAILED_EXIT_CODE = 1
PLAN = "sweep.json"
LOG = "sweep.log"
SBATCH = "sweep.sbatch"
MAX_NAME_CHARS = 120  # a run directory's name; longer ones are cut and get a digest of the whole
_UNSAFE = re.compile(r"[^A-Za-z0-9._+\-=,\[\]@%]")  # what a run directory's name keeps as it is
_OPENING, _CLOSING = "[{(", "]})"


def split_values(text: str) -> list[str]:
    """A value list split at its top-level commas: not inside [], {}, () or a quoted string ('...' or "...").
    `[64,64],[32,32]` -> ['[64,64]', '[32,32]']; `3e-4` -> ['3e-4']."""
    items, start, depth, quote = [], 0, 0, ""
    for index, char in enumerate(text):
        if quote:
            if char == quote and not (quote == '"' and text[index - 1] == "\\"):
                quote = ""
        elif char in "'\"" and (index == 0 or text[index - 1] in " ,:[{("):  # where YAML starts a quoted scalar
            quote = char
        elif char in _OPENING:
            depth += 1
        elif char in _CLOSING:
            depth = max(depth - 1, 0)  # an unbalanced bracket: the config check names the value
        elif char == "," and depth == 0:
            items.append(text[start:index])
            start = index + 1
    items.append(text[start:])
    return items


@dataclass
class Combination:
    name: str  # its run directory's name: the swept keys' values, e.g. learning_rate=3e-4,seed=1
    overrides: list[str]  # the swept keys' items, e.g. ['algo.learning_rate=3e-4', 'train.seed=1']


def parse_overrides(items: list[str]) -> tuple[list[str], list[tuple[str, list[str]]]]:
    """(the overrides every run gets, the swept keys with their values in command-line order)."""
    common, swept = [], []
    for item in items:
        key, sep, text = item.partition("=")
        values = split_values(text) if sep else [text]
        if len(values) == 1:
            common.append(item)  # also what is no override at all: the config check names it
            continue
        if any(not value.strip() for value in values):
            raise UserError(f"override {item!r} has an empty value in its comma list; give each value once")
        repeated = sorted({value for value in values if values.count(value) > 1})
        if repeated:
            raise UserError(f"override {item!r} lists {', '.join(repeated)} more than once; give each value once")
        swept.append((key, values))
    return common, swept


def combinations(swept: list[tuple[str, list[str]]]) -> list[Combination]:
    """The cartesian product of the swept values (the first key varies slowest), each with its directory name."""
    if not swept:
        return [Combination("run", [])]
    tails = [key.rpartition(".")[2] for key, _ in swept]
    shown = [tail if tails.count(tail) == 1 else key for tail, (key, _) in zip(tails, swept)]
    result = []
    for values in itertools.product(*(values for _, values in swept)):
        label = ",".join(f"{name}={value}" for name, value in zip(shown, values))
        result.append(Combination(label, [f"{key}={value}" for (key, _), value in zip(swept, values)]))
    names = [_safe_name(c.name) for c in result]
    for combination, name in zip(result, names):  # two labels that read alike once cleaned: both get a digest
        combination.name = name if names.count(name) == 1 else _digested(name, combination.name)
    return result


def _safe_name(label: str) -> str:
    name = _UNSAFE.sub("_", label)
    return name if len(name) <= MAX_NAME_CHARS else _digested(name, label)


def _digested(name: str, label: str) -> str:
    return f"{name[: MAX_NAME_CHARS - 9]}-{hashlib.sha256(label.encode()).hexdigest()[:8]}"


@dataclass
class Sweep:
    """A checked sweep: where it lives and what each of its runs is given."""

    directory: Path
    config: str | None  # the --config file as given (relative to workdir), or None for the embedded default
    common: list[str]
    combinations: list[Combination]
    digests: list[str]  # each combination's Config.resume_digest(): what a resume must share
    workdir: str  # the directory the sweep was started in (relative paths are relative to it)

    def run_dir(self, combination: Combination) -> Path:
        return self.directory / combination.name

    def run_args(self, combination: Combination) -> list[str]:
        """What follows `-m spmd_rl.main` (or slurm/train.sh, without --config) for this combination."""
        config = ["--config", self.config] if self.config is not None else []
        return [*config, f"run.dir={self.run_dir(combination)}", *self.common, *combination.overrides]

    def finished(self, index: int) -> bool:
        """The run is finished and is this combination's (a reused --dir may hold another config's run)."""
        run_dir = self.run_dir(self.combinations[index])
        if not (run_dir / FINISHED).exists():
            return False
        try:
            # The digest of the config as the command gave it: config.yaml holds the env counts the run's plan
            # resolved for its world size (env.total_envs, env.groups), which the sweep does not know.
            given = json.loads((run_dir / FINISHED).read_text()).get("config_digest")
            if given is None:  # a run finished before finished.json recorded it
                given = load_config(run_dir / CONFIG_FILE).resume_digest()
            return given == self.digests[index]
        except (UserError, OSError, ValueError, AttributeError):
            return False  # damaged: let spmd_rl.main say what it finds

    def plan(self) -> dict:
        return {
            "config": self.config,
            "common": self.common,
            "combinations": [{"name": c.name, "overrides": c.overrides} for c in self.combinations],
            "digests": self.digests,
            "workdir": self.workdir,
        }

    def write_plan(self, **extra) -> None:
        """Write sweep.json (a UserError naming the path when the directory cannot be made or written: --dir or
        --root under /proc, read-only, a file in the way was an OSError traceback; fault pass 9, SW1)."""
        make_dirs(self.directory)
        text = json.dumps({**self.plan(), **extra}, indent=1) + "\n"
        temporary = self.directory / f".{PLAN}.tmp"
        try:
            temporary.write_text(text)
            temporary.replace(self.directory / PLAN)
        except OSError as exc:
            raise file_error(self.directory / PLAN, exc, "cannot write") from None

    @classmethod
    def read(cls, directory: Path) -> tuple[Sweep, dict]:
        path = directory / PLAN
        try:
            plan = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise UserError(f"{path} cannot be read ({exc}): give the directory of a sweep") from None
        combinations_ = [Combination(c["name"], c["overrides"]) for c in plan["combinations"]]
        sweep = cls(directory, plan["config"], plan["common"], combinations_, plan["digests"], plan["workdir"])
        return sweep, plan


def plan_sweep(config: str | None, overrides: list[str], root: Path, directory: Path | None, name: str) -> Sweep:
    """Every combination checked with load_config (UserError naming the first bad one), and the sweep directory."""
    if any(item.partition("=")[0] == "run.dir" for item in overrides):
        raise UserError("the sweep gives each run its own run.dir under the sweep directory; drop run.dir (use --dir)")
    common, swept = parse_overrides(overrides)
    combos = combinations(swept)
    digests, run_name = [], None
    for combination in combos:
        try:
            cfg = load_config(config, [*common, *combination.overrides])
        except UserError as exc:
            where = f"combination {combination.name}: " if swept else ""
            raise UserError(f"{where}{exc}") from None
        digests.append(cfg.resume_digest())
        run_name = run_name or cfg.run.name
    if directory is None:
        whole = json.dumps([[c.name, d] for c, d in zip(combos, digests)]).encode()
        directory = root / f"sweep-{name or run_name}-{hashlib.sha256(whole).hexdigest()[:8]}"
    return Sweep(directory, config, common, combos, digests, os.getcwd())


# -- sequentially, in this process's care ------------------------------------------------------------------------


class _Signals:
    """SIGINT/SIGTERM/SIGUSR1 to the sweep: passed on to the running run once (it stops with a checkpoint), and the
    sweep stops after it. The runs have their own session, so a Ctrl-C reaches them only this way, once."""

    NAMES = {signal.SIGINT: "SIGINT", signal.SIGTERM: "SIGTERM", signal.SIGUSR1: "SIGUSR1"}

    def __init__(self) -> None:
        self.received: str = ""
        self.child: subprocess.Popen | None = None
        self.pending: int | None = None  # a signal that came while no run was known to this object
        self.previous = {number: signal.signal(number, self._handle) for number in self.NAMES}

    def _handle(self, number, frame) -> None:
        self.received = self.received or self.NAMES[number]
        if self.child is not None and self.child.poll() is None:
            self.child.send_signal(number)
        else:
            self.pending = number

    def started(self, child: subprocess.Popen) -> None:
        """The run just started: a signal that came while Popen returned (the run already up, not yet known here:
        a fresh-clone CI at load lost it, and the sweep waited for the run forever) is passed on now."""
        self.child = child
        pending, self.pending = self.pending, None
        if pending is not None and child.poll() is None:
            child.send_signal(pending)

    def restore(self) -> None:
        for number, handler in self.previous.items():
            signal.signal(number, handler)


def run_sequentially(sweep: Sweep, launcher: list[str]) -> int:
    total = len(sweep.combinations)
    print(f"spmd_rl.sweep: {total} run(s) in {sweep.directory} (each run's output: <run dir>/{LOG})", flush=True)
    failed, stopped, skipped, done = [], [], 0, 0
    signals = _Signals()
    try:
        for index, combination in enumerate(sweep.combinations):
            run_dir = sweep.run_dir(combination)
            head = f"[{index + 1}/{total}] {combination.name}"
            if sweep.finished(index):
                print(f"{head}: finished earlier, skipped", flush=True)
                skipped += 1
                continue
            command = [*launcher, "-m", "spmd_rl.main", *sweep.run_args(combination)]
            run_dir.mkdir(parents=True, exist_ok=True)
            print(f"{head}: running", flush=True)
            start = time.monotonic()
            with open(run_dir / LOG, "a") as log:
                log.write(f"==== {time.strftime('%Y-%m-%d %H:%M:%S')} {shlex.join(command)}\n")
                log.flush()
                child = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
                signals.started(child)
                code = _wait(child)
                signals.child = None
            seconds = time.monotonic() - start
            if code == 0:
                done += 1
                print(f"{head}: done in {seconds:.1f} s", flush=True)
            elif code == STOPPED_EXIT_CODE:
                stopped.append(combination.name)
                print(f"{head}: stopped with a checkpoint after {seconds:.1f} s", flush=True)
            else:
                failed.append(f"{combination.name} (exit {code}; {run_dir / LOG})")
                print(f"{head}: failed with exit {code} after {seconds:.1f} s: {_last_line(run_dir / LOG)}", flush=True)
            if signals.received:
                print(
                    f"spmd_rl.sweep: stopped by {signals.received} during {combination.name}; rerun the same command "
                    f"to resume (finished runs are skipped)",
                    file=sys.stderr,
                    flush=True,
                )
                return STOPPED_EXIT_CODE
    finally:
        signals.restore()
    plot = (
        f"python -m spmd_rl.plot {shlex.quote(str(sweep.directory))} -o {shlex.quote(str(sweep.directory))}/curves.png"
    )
    counts = f"{done} done, {skipped} skipped (finished earlier)"
    if failed or stopped:
        parts = []
        if failed:
            parts.append(f"{len(failed)} of {total} failed: {'; '.join(failed)}")
        if stopped:
            parts.append(f"{len(stopped)} stopped with a checkpoint ({', '.join(stopped)}; rerun to resume)")
        print(f"spmd_rl.sweep: {'; '.join(parts)}; {counts}", file=sys.stderr, flush=True)
        return FAILED_EXIT_CODE if failed else STOPPED_EXIT_CODE
    print(f"spmd_rl.sweep: all {total} runs finished ({counts}); curves: {plot}", flush=True)
    return 0


def _wait(child: subprocess.Popen) -> int:
    while True:
        try:
            return child.wait()
        except KeyboardInterrupt:  # not expected (our handler replaces Python's), but never leave a run behind
            continue


def _last_line(path: Path) -> str:
    try:
        lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "(no log)"
    return lines[-1][-300:] if lines else "(no output)"


# -- as a Slurm job array -----------------------------------------------------------------------------------------


def write_sbatch(sweep: Sweep, slurm_script: Path, job_name: str) -> Path:
    """<sweep dir>/sweep.sbatch: slurm_script's #SBATCH lines (job name and log replaced, the array added), then
    the task entry, which runs combination $SLURM_ARRAY_TASK_ID through slurm_script."""
    directives = [
        line
        for line in slurm_script.read_text().splitlines()
        if line.startswith("#SBATCH") and not re.match(r"#SBATCH\s+--(job-name|output|array)\b", line)
    ]
    directory = Path(sweep.workdir, sweep.directory).resolve()
    home = slurm_script.parent.parent if (slurm_script.parent / "common.sh").exists() else Path(sweep.workdir)
    lines = [
        "#!/usr/bin/env bash",
        f"# Written by python -m spmd_rl.sweep: a Slurm job array, task i runs combination i of {PLAN} (next to this",
        f"# file) through {slurm_script}, whose #SBATCH lines follow (job name, log and array set here).",
        f"# Submit: sbatch {shlex.quote(str(directory / SBATCH))}  (sbatch options on the command line win)",
        f"#SBATCH --job-name={job_name}",
        f"#SBATCH --array=0-{len(sweep.combinations) - 1}",
        f"#SBATCH --output={directory}/slurm-%A_%a.out",
        *directives,
        "set -euo pipefail",
        f"cd {shlex.quote(sweep.workdir)}",
        f"export SPMD_RL_HOME=${{SPMD_RL_HOME:-{shlex.quote(str(home))}}}",
        f"export PYTHON=${{PYTHON:-{shlex.quote(sys.executable)}}}",
        f'exec "$PYTHON" -m spmd_rl.sweep --task {shlex.quote(str(directory))}',
    ]
    path = sweep.directory / SBATCH
    path.write_text("\n".join(lines) + "\n")
    return path


def run_task(directory: Path, index_text: str | None) -> int:
    """A job array's task: combination $SLURM_ARRAY_TASK_ID (or --index) through the plan's Slurm script, in this
    process (exec: Slurm's signals reach the script's traps). A finished run is skipped."""
    sweep, plan = Sweep.read(directory)
    if index_text is None:
        raise UserError("--task runs combination $SLURM_ARRAY_TASK_ID, which is not set: give --index N")
    total = len(sweep.combinations)
    if not index_text.isdigit() or int(index_text) >= total:
        raise UserError(f"combination {index_text!r} is not one of the {total} of {directory} (0..{total - 1})")
    index = int(index_text)
    combination = sweep.combinations[index]
    sweep.directory = directory
    if sweep.finished(index):
        print(f"spmd_rl.sweep: combination {index} ({combination.name}) finished earlier; nothing to do", flush=True)
        return 0
    script = plan.get("slurm_script")
    if not script:
        raise UserError(f"{directory / PLAN} was not written with --slurm: run the sweep's command instead")
    args = sweep.run_args(combination)
    if sweep.config is not None:
        args = args[2:]  # slurm/train.sh takes the config file first, without --config
    command = ["bash", script, sweep.config or "", *args]
    print(
        f"spmd_rl.sweep: combination {index} of 0..{total - 1}: {combination.name}: {shlex.join(command)}", flush=True
    )
    os.execvp("bash", command)
    return 0  # not reached


def submit(path: Path, sbatch_args: list[str]) -> int:
    command = ["sbatch", "--parsable", *sbatch_args, str(path)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        print(f"spmd_rl.sweep: error: {shlex.join(command)} failed: {done.stderr.strip()}", file=sys.stderr)
        return FAILED_EXIT_CODE
    job = done.stdout.strip().split(";")[0]
    print(f"spmd_rl.sweep: submitted job array {job} ({path}); logs: {path.parent}/slurm-{job}_<task>.out")
    return 0


# -- the command line ---------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m spmd_rl.sweep",
        description=__doc__,
        epilog="examples:\n"
        "  python -m spmd_rl.sweep --config configs/ppo_cartpole.yaml train.seed=1,2,3 algo.learning_rate=3e-4,1e-3\n"
        "  python -m spmd_rl.sweep --config configs/ppo_cartpole.yaml train.seed=1,2 "
        "policy.hidden_sizes=[64,64],[32,32]\n"
        '  python -m spmd_rl.sweep --launcher "torchrun --standalone --nproc_per_node=4" --config ... train.seed=1,2\n'
        "  python -m spmd_rl.sweep --slurm --sbatch-args='--time=01:00:00' --config ... train.seed=1,2,3\n"
        "then: python -m spmd_rl.plot SWEEP_DIR -o curves.png",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--config", metavar="FILE", action=OneConfig, help="YAML config (default: the embedded PPO CartPole-v1 config)"
    )
    parser.add_argument("--root", type=Path, default=Path("runs"), help="where sweep directories go (default: runs)")
    parser.add_argument("--dir", type=Path, help="the sweep directory (default: ROOT/sweep-<run.name>-<digest>)")
    parser.add_argument("--name", default="", help="the sweep directory's name part (default: run.name)")
    parser.add_argument(
        "--launcher",
        default="",
        help="what runs `-m spmd_rl.main ...` for each run (default: this Python), e.g. "
        '"torchrun --standalone --nproc_per_node=4" or "mpirun -np 4 python"',
    )
    parser.add_argument("--slurm", action="store_true", help="write SWEEP_DIR/sweep.sbatch, a job array, and submit it")
    parser.add_argument("--no-submit", action="store_true", help="with --slurm: only write the script")
    parser.add_argument(
        "--slurm-script",
        type=Path,
        default=Path(__file__).resolve().parent.parent / "slurm" / "train.sh",
        help="what each array task runs (default: slurm/train.sh; or slurm/train_srun.sh)",
    )
    parser.add_argument("--sbatch-args", default="", help="more sbatch options, e.g. '--time=01:00:00 --nodes=2'")
    parser.add_argument("--task", type=Path, metavar="SWEEP_DIR", help=argparse.SUPPRESS)  # a job array's task
    parser.add_argument("--index", help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", metavar="section.key=v1,v2,...", help="overrides; comma lists sweep")
    return parser.parse_intermixed_args(argv)  # overrides on both sides of an option (fault pass 9, CLI1)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.task is not None:
            return run_task(args.task, args.index if args.index is not None else os.environ.get("SLURM_ARRAY_TASK_ID"))
        launcher = shlex.split(args.launcher) if args.launcher else [sys.executable]
        if shutil.which(launcher[0]) is None:
            raise UserError(f"--launcher {args.launcher!r}: {launcher[0]} is not found on PATH")
        if args.slurm:
            if args.config is None:
                raise UserError("--slurm needs --config FILE (the Slurm scripts take a config file)")
            if not args.slurm_script.is_file():
                raise UserError(f"--slurm-script {args.slurm_script} does not exist")
            if not args.no_submit and shutil.which("sbatch") is None:
                raise UserError("--slurm: sbatch is not on PATH; add --no-submit to only write the script")
        sweep = plan_sweep(args.config, args.overrides, args.root, args.dir, args.name)
        if args.slurm:
            sweep.write_plan(slurm_script=str(args.slurm_script.resolve()))
        else:
            sweep.write_plan()
    except UserError as exc:
        print(f"spmd_rl.sweep: error: {exc}", file=sys.stderr)
        return USER_ERROR_EXIT_CODE
    if not args.slurm:
        return run_sequentially(sweep, launcher)
    path = write_sbatch(sweep, args.slurm_script.resolve(), sweep.directory.name)
    print(f"spmd_rl.sweep: {len(sweep.combinations)} run(s) in {sweep.directory}; job array script {path}")
    if args.no_submit:
        print(f"submit it with: {shlex.join(['sbatch', *shlex.split(args.sbatch_args), str(path)])}")
        return 0
    return submit(path, shlex.split(args.sbatch_args))


if __name__ == "__main__":
    sys.exit(main())
