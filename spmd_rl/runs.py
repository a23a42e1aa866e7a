"""The runs under a directory and how each stands: `python -m spmd_rl.runs [DIR ...]` (default: runs/).

One line per run directory (a directory holding config.yaml or metrics.jsonl, searched as spmd_rl.plot searches:
runs/<run>, runs/<sweep>/<run>), read from the files every run already writes:

    state     running   rank 0 holds the run directory's flocks now (free once the process is gone, however it ended)
              finished  finished.json: done, or run.stop_at_return reached; never resumed (a finished.json that is
                        no finished run's record is a damage note, and the state is what run.lock recorded)
              stopped   exit 75: a checkpointed stop (a signal, run.stop_after_iterations); rerun to resume
              failed    any other exit code run.lock recorded (2 bad input, 3 communication, 4 user code, 1 a bug)
              killed    run.lock is free and recorded no exit: kill -9, a lost node, the watchdog, or a run from before
                        exit codes were recorded
              unknown   no run.lock but metrics: a run from before run.lock, or a directory copied without it
              new       neither: a directory no run has logged in yet
    iters, env steps (of train.total_steps), the last mean episode return and evaluation return, and when
    metrics.jsonl was last written. The directory's name says which config it runs (its digest); spmd_rl.plot's
    labels say which keys set runs apart.

Damaged files are read as far as they are sound, the run's state is marked damaged, and what is damaged is named
in a note below the table, never a traceback. Nothing a damaged or planted directory holds can hang or exhaust the
listing: only regular files are read (not a FIFO, not a link to /dev/zero), config.yaml through the config's own
bounded loader (no alias bomb), metrics.jsonl's last METRICS_TAIL_BYTES only, and lines up to METRICS_LINE_BYTES;
a resumable run's newest committed checkpoint by its rank files' sizes against its COMPLETE marker (MARKER_BYTES).
--json prints one JSON object per run instead, for scripts. This module imports no torch: it answers at once.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

from spmd_rl.config.loading import MAX_CONFIG_BYTES, ConfigLoader
from spmd_rl.persist.fileio import NotRegularFile, bounded_lines, file_kind, open_regular
from spmd_rl.persist.run_files import (
    CHECKPOINT_PREFIX,
    CHECKPOINTS_DIR,
    COMPLETE_MARKER,
    CONFIG_FILE,
    FINISHED,
    LOCK_FILE,
    METRICS_FILE,
    METRICS_LINE_BYTES,
    SHARDS_DIR,
    SHARDS_METADATA,
    finished_damage,
)
from spmd_rl.persist.run_lock import note_damage, read_lock
from spmd_rl.plot import SEARCH_DEPTH, is_run_dir, run_dirs_inside
from spmd_rl.runtime.errors import STOPPED_EXIT_CODE, USER_ERROR_EXIT_CODE

METRICS_TAIL_BYTES = 16 << 20  # what the index reads of a metrics.jsonl: its last records are what it shows
MARKER_BYTES = 1 << 20  # a checkpoint's COMPLETE marker (names and sizes of its rank files: a few hundred bytes)


@dataclass
class RunStatus:
    directory: str
    state: str
    iterations: int | None = None  # iterations logged (the last one's number + 1)
    env_steps: int | None = None
    total_steps: int | None = None
    last_return: float | None = None  # the last logged episode_return_mean
    last_eval_return: float | None = None
    updated: float | None = None  # metrics.jsonl's modification time
    exit_code: int | None = None
    holder: str = ""  # 'host vm, pid 123' while running
    notes: list[str] = field(default_factory=list)


def find_runs(paths: list[Path]) -> list[Path]:
    """The run directories under paths, in sorted order, searched SEARCH_DEPTH deep."""
    found = []
    for path in paths:
        if is_run_dir(path):
            found.append(path)
        elif path.is_dir():
            found.extend(run_dirs_inside(path, SEARCH_DEPTH, sweep_order=False))
    return found


def run_status(run_dir: Path) -> tuple[RunStatus, dict]:
    """A run's status and its config (as config.yaml holds it; {} when missing or damaged)."""
    status = RunStatus(str(run_dir), "new")
    config = _read_config(run_dir, status.notes)
    held, lock = read_lock(run_dir)
    finished_note = finished_damage(run_dir)  # a finished.json that is no finished run's record: listed as damage
    if finished_note:
        status.notes.append(
            f"{finished_note}: the run is not taken for finished (a resume refuses until it is removed)"
        )
    if held:
        status.state = "running"
        status.holder = f"host {lock.get('host', '?')}, pid {lock.get('pid', '?')}"
    elif (run_dir / FINISHED).exists() and (not finished_note or lock.get("exit_code") == 0):  # 0: it did finish
        status.state = "finished"
    elif isinstance(lock.get("exit_code"), int):
        status.exit_code = lock["exit_code"]
        status.state = "stopped" if status.exit_code == STOPPED_EXIT_CODE else "failed"
    elif lock or os.path.lexists(run_dir / LOCK_FILE):
        status.state = "killed"
        damage = note_damage(run_dir)
        if damage:
            status.notes.append(damage)
    elif (run_dir / METRICS_FILE).exists():
        status.state = "unknown"  # logged without run.lock: a run from before run.lock, or a copied directory
    if status.state == "finished" and isinstance(lock.get("exit_code"), int):
        status.exit_code = lock["exit_code"]
    if status.state in ("stopped", "failed", "killed", "unknown"):  # what a rerun would resume from
        _note_checkpoint_damage(run_dir, status.notes)
    _read_metrics(run_dir, status)
    total = config.get("train", {}).get("total_steps") if isinstance(config.get("train"), dict) else None
    status.total_steps = total if isinstance(total, int) else None
    return status, config


def _note_checkpoint_damage(run_dir: Path, notes: list[str]) -> None:
    """A note when the newest committed checkpoint's rank files differ in size from what its COMPLETE marker
    recorded, or are gone: the first check a resume makes (persist/checkpoint.py, rank_file_damage), by size alone
    here (no rank file is read), so that a run a rerun cannot resume as listed is not shown as only 'stopped'."""
    root = run_dir / CHECKPOINTS_DIR
    try:
        with os.scandir(root) as entries:
            names = [
                e.name for e in entries if e.name.startswith(CHECKPOINT_PREFIX) and e.is_dir(follow_symlinks=False)
            ]
    except OSError:
        return
    numbered = sorted(
        (int(name[len(CHECKPOINT_PREFIX) :]), name) for name in names if name[len(CHECKPOINT_PREFIX) :].isdigit()
    )
    for _, name in reversed(numbered):
        marker_path = root / name / COMPLETE_MARKER
        try:
            with open_regular(marker_path) as file:
                marker = json.loads(file.read(MARKER_BYTES))
        except FileNotFoundError:
            continue  # an interrupted save: a resume never loads it
        except (OSError, ValueError):
            notes.append(f"{marker_path} cannot be read: a resume steps back to an older checkpoint, if any")
            return
        files = marker.get("files") if isinstance(marker, dict) else None
        for file_name, saved in files.items() if isinstance(files, dict) else ():
            path = root / name / str(file_name)
            try:
                size = os.lstat(path).st_size
            except OSError:
                size = None
            if size != saved:
                found = "is missing" if size is None else f"is truncated or altered ({size} bytes, {saved} when saved)"
                notes.append(
                    f"checkpoint file {path} {found}: a resume steps back to an older complete checkpoint, or is "
                    f"refused where there is none"
                )
                return
        # the shard files of sharded trainers are not in the marker; DCP's index of them is what a resume reads first
        shards = root / name / SHARDS_DIR
        if shards.is_dir() and not (shards / SHARDS_METADATA).is_file():
            notes.append(
                f"{shards / SHARDS_METADATA} is missing: a resume of the sharded weights is refused (restore the "
                f"checkpoint from a copy)"
            )
        return  # the newest committed checkpoint is the one a resume loads


def _read_config(run_dir: Path, notes: list[str]) -> dict:
    path = run_dir / CONFIG_FILE
    try:
        with open_regular(path) as file:
            text = file.read(MAX_CONFIG_BYTES + 1)
        if len(text) > MAX_CONFIG_BYTES:
            raise ValueError(f"larger than {MAX_CONFIG_BYTES >> 20} MiB")
        config = yaml.load(text.decode(errors="replace"), Loader=ConfigLoader)  # bounded: no alias bomb
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, yaml.YAMLError) as exc:
        if isinstance(exc, NotRegularFile):
            notes.append(f"{exc}: its keys are not compared")
        elif isinstance(exc, OSError):
            notes.append(f"{path} cannot be read ({exc.strerror}): its keys are not compared")
        else:  # a _TooLarge's problem names the bound it passed
            why = getattr(exc, "problem", None) or str(exc)
            notes.append(f"{path} does not load ({why.splitlines()[0]}): its keys are not compared")
        return {}
    return config if isinstance(config, dict) else {}


def _read_metrics(run_dir: Path, status: RunStatus) -> None:
    """The last record's counters and the last returns; lines that are no JSON object are skipped and counted."""
    path = run_dir / METRICS_FILE
    try:
        with open_regular(path) as file:
            info = os.fstat(file.fileno())
            status.updated = info.st_mtime
            file.seek(max(0, info.st_size - METRICS_TAIL_BYTES))
            lines = list(bounded_lines(file, METRICS_LINE_BYTES))
    except FileNotFoundError:
        return
    except OSError as exc:
        status.notes.append(str(exc) if isinstance(exc, NotRegularFile) else f"{path} cannot be read ({exc.strerror})")
        return
    if info.st_size > METRICS_TAIL_BYTES and lines and lines[0] is not None:
        lines.pop(0)  # the tail's first line is the end of a sound one, most likely: not damage
    damaged = 0
    for number, line in enumerate(lines, start=1):
        try:
            if line is None:
                raise ValueError("longer than METRICS_LINE_BYTES")
            record = json.loads(line)
            if not isinstance(record, dict):
                raise ValueError(line)
        except (ValueError, RecursionError):  # deeply nested brackets are a RecursionError
            damaged += number < len(lines) or bool(line is None or line.strip())  # a torn last line is data lost
            continue
        if isinstance(record.get("iteration"), int):
            status.iterations = record["iteration"] + 1
        if isinstance(record.get("env_steps"), int):
            status.env_steps = record["env_steps"]
        if _is_number(record.get("episode_return_mean")):
            status.last_return = record["episode_return_mean"]
        if _is_number(record.get("eval_return_mean")):
            status.last_eval_return = record["eval_return_mean"]
    if damaged:
        status.notes.append(f"{path}: {damaged} line(s) that are no JSON record skipped")


def statuses(run_dirs: list[Path]) -> list[RunStatus]:
    return [run_status(run_dir)[0] for run_dir in run_dirs]


def format_table(rows: list[RunStatus], root: Path | None, now: float) -> str:
    def name(row: RunStatus) -> str:
        path = Path(row.directory)
        if root is not None:
            try:
                relative = path.relative_to(root)
                if relative.parts:  # the root itself is a run: its own path, not "."
                    return str(relative)
            except ValueError:
                pass
        return str(path)

    def state(row: RunStatus) -> str:
        shown = f"{row.state} ({row.exit_code})" if row.state in ("stopped", "failed") else row.state
        if row.holder:
            shown = f"{shown} ({row.holder})"
        return f"{shown}, damaged" if row.notes else shown  # the notes below the table say what is damaged

    def steps(row: RunStatus) -> str:
        if row.env_steps is None:
            return "-"
        return f"{row.env_steps}/{row.total_steps}" if row.total_steps else str(row.env_steps)

    def number(value) -> str:
        return "-" if value is None else f"{value:.2f}"

    header = ("RUN", "STATE", "ITERS", "ENV STEPS", "RETURN", "EVAL", "UPDATED")
    table = [
        (
            name(row),
            state(row),
            "-" if row.iterations is None else str(row.iterations),
            steps(row),
            number(row.last_return),
            number(row.last_eval_return),
            "-" if row.updated is None else _ago(now - row.updated),
        )
        for row in rows
    ]
    widths = [max(len(cells[i]) for cells in (header, *table)) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(cells, widths)) for cells in (header, *table)]
    lines = [line.rstrip() for line in lines]
    lines += [f"note: {note}" for row in rows for note in row.notes]
    return "\n".join(lines)


def _ago(seconds: float) -> str:
    seconds = max(0.0, seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f} {unit} ago"
    return f"{seconds:.0f} s ago"


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value  # not NaN


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m spmd_rl.runs", description=__doc__.splitlines()[0])
    parser.add_argument(
        "paths", nargs="*", type=Path, default=[Path("runs")], metavar="DIR", help="a directory of runs (default runs/)"
    )
    parser.add_argument("--json", action="store_true", help="one JSON object per run instead of the table")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `| head`: end quietly, as ls does
    missing = [str(path) for path in args.paths if not path.exists()]
    if missing:
        print(
            f"error: {', '.join(missing)} does not exist: give a directory holding runs (runs/, a sweep's)",
            file=sys.stderr,
        )
        return USER_ERROR_EXIT_CODE
    others = [f"{path} is {file_kind(path.stat().st_mode)}" for path in args.paths if not path.is_dir()]
    if others:  # a FIFO, a device, a file: nothing to list runs under
        print(f"error: {'; '.join(others)}: give a directory holding runs (runs/, a sweep's)", file=sys.stderr)
        return USER_ERROR_EXIT_CODE
    rows = statuses(find_runs(args.paths))
    if args.json:
        for row in rows:
            print(json.dumps(asdict(row)))
        return 0
    if not rows:
        print(f"no runs under {', '.join(map(str, args.paths))}")
        return 0
    root = args.paths[0] if len(args.paths) == 1 else None
    print(format_table(rows, root, time.time()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
