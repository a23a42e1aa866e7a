"""Shared helpers of the benchmarks: run spmd_rl as a user would (a subprocess per run) and read its metrics."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the tests' launcher helper: launch lines are spelled in one place

from harness.launch import command, free_port  # noqa: E402 (after the path it is found on)

__all__ = [
    "ROOT",
    "SPLIT_ONE_ENV_PER_RANK",
    "command",
    "free_port",
    "machine",
    "run_spmd",
    "table",
    "versions",
    "versions_line",
]

# The split layout the scaling benchmarks grow (add layout.env): one env per env rank stepped in-process, segments
# of 64 steps learned in 4 epochs, one trainer and one inference rank.
SPLIT_ONE_ENV_PER_RANK = [
    "env.num_envs=1",
    "env.vectorization=sync",
    "algo.num_steps=64",
    "algo.update_epochs=4",
    "layout.mode=split",
    "layout.trainer=1",
    "layout.inference=1",
]


def machine() -> str:
    return (
        f"{platform.node()}: {os.cpu_count()} cores, {platform.processor() or platform.machine()}, "
        f"Python {platform.python_version()}, torch {torch.__version__}, "
        f"{'CUDA' if torch.cuda.is_available() else 'no GPU'}"
    )


def versions() -> dict[str, str]:
    """The versions a learning number depends on (physics releases change trajectories): written beside every
    learning benchmark's numbers. A package that is not installed is "-"."""
    from importlib import metadata

    found = {"python": platform.python_version()}
    for package in ("torch", "gymnasium", "mujoco", "envpool", "numpy", "ale-py", "stable-baselines3"):
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[package] = "-"
    return found


def versions_line() -> str:
    return "versions: " + ", ".join(f"{name} {version}" for name, version in versions().items())


def run_spmd(
    overrides: list[str],
    nproc: int = 0,
    config: str | None = None,
    timeout: float = 1800,
    root: Path = ROOT,
    user_code: Path | None = None,
    run_dir: Path | None = None,
) -> list[dict]:
    """Run `python -m spmd_rl.main` (under torchrun when nproc > 0) and return its metrics records. root: the
    checkout whose spmd_rl runs (another one, e.g. a `git worktree` of an older commit, to compare in one run).
    user_code: a folder of user modules (an example's) importable by the run, as its working directory would be.
    run_dir: where the run writes (a new temporary directory by default)."""
    run_dir = Path(tempfile.mkdtemp(prefix="spmd_bench_")) if run_dir is None else run_dir
    args = (
        (["--config", config] if config else [])
        + overrides
        + [f"run.dir={run_dir}", "log.progress=false", "log.tensorboard=false", "log.interval_s=1000000"]
    )
    cmd = [*(command("torchrun", nproc) if nproc else command("none")), *args]
    path = os.pathsep.join([str(root), *([str(user_code)] if user_code else [])])
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONPATH=path)
    result = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({result.returncode}):\n{result.stderr[-3000:]}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def table(headers: list[str], rows: list[list]) -> str:
    """A Markdown table: pasteable into benchmarks/README.md as printed."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]

    def line(values: list[str]) -> str:
        return "| " + " | ".join(v.ljust(w) for v, w in zip(values, widths)) + " |"

    return "\n".join([line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, cells)])
