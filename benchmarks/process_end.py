"""Seconds from a process's last line to its exit, one process, of this checkout and (alternating) another one.

    python benchmarks/process_end.py [--repeats 3] [--compare-tree DIR]

- refused copy: `python -m spmd_rl.main --config configs/ci_tiny.yaml` started on a run directory another copy of
  the same command holds (it runs meanwhile): from its refusal line ('... is in use by another run ...') to its
  exit (fault pass 2026-12-07, W1c);
- finished run: the same config to its end (8 iterations), from its 'done: ...' line to its exit.
DIR is another checkout (e.g. `git worktree add --detach /tmp/old <commit>`); each is on PYTHONPATH in turn.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT

CONFIG = ["--config", str(ROOT / "configs" / "ci_tiny.yaml")]


def seconds_after_line(tree: Path, args: list[str], marker: str, cwd: str) -> float:
    """Start spmd_rl.main from tree with args in cwd (outside any checkout: `-m` looks in the working directory
    before PYTHONPATH); seconds from its first line holding marker to its exit."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    process = subprocess.Popen(
        [sys.executable, "-m", "spmd_rl.main", *CONFIG, *args],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    assert process.stdout is not None
    for line in process.stdout:
        if marker in line:
            said = time.monotonic()
            break
    else:
        raise SystemExit(f"{tree}: no line with {marker!r} (exit {process.wait()})")
    process.stdout.read()
    process.wait()
    return time.monotonic() - said


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compare-tree", type=Path, help="another checkout, measured alternating with this one")
    options = parser.parse_args()
    trees = [("this checkout", ROOT)] + ([("compared", options.compare_tree)] if options.compare_tree else [])
    with tempfile.TemporaryDirectory() as scratch:
        held = Path(scratch) / "held"
        holder = subprocess.Popen(
            [sys.executable, "-m", "spmd_rl.main", *CONFIG, "train.total_steps=100000000", f"run.dir={held}"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            cwd=scratch,
        )
        assert holder.stdout is not None
        holder.stdout.readline()  # its start line: the run directory is locked
        try:
            for repeat in range(options.repeats):
                for name, tree in trees:
                    refused = seconds_after_line(tree, [f"run.dir={held}"], "in use by another run", scratch)
                    run_dir = Path(scratch) / f"{name}{repeat}"
                    done = seconds_after_line(tree, [f"run.dir={run_dir}"], "done: ", scratch)
                    print(
                        f"{name}: refused copy {refused:.2f} s, finished run {done:.2f} s after the line "
                        f"(load {os.getloadavg()[0]:.1f})",
                        flush=True,
                    )
        finally:
            holder.send_signal(signal.SIGTERM)
            holder.wait()


if __name__ == "__main__":
    main()
