"""benchmarks/learning.py --config (the seed runner) resumes a stopped benchmark: a seed whose run stopped part way
is resumed from its checkpoint (no iteration runs twice), a fresh seed starts, finished seeds are skipped on a
rerun, and the table of the finished seeds with the versions lands in results.md. Each finished seed leaves a results
file (--results, kept in git) from which a fresh machine without the run directories skips it and reports it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from harness.launch import ROOT

import spmd_rl

CONFIG = ROOT / "configs" / "ci_tiny.yaml"
OVERRIDES = ["eval.every=4", "eval.episodes=2"]  # 8 iterations: the last one is evaluated


def seed_runner(out: Path, seeds: int, *flags: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "learning.py"), "--config", str(CONFIG), "--seeds", str(seeds)]
    cmd += ["--results", str(out / "results"), *flags]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(
        [*cmd, "--out", str(out), *OVERRIDES], cwd=out, env=env, capture_output=True, text=True, timeout=240
    )


@pytest.mark.slow
def test_a_stopped_benchmark_resumes_its_unfinished_seeds(tmp_path):
    where = tmp_path / "ci_tiny+eval.every=4+eval.episodes=2"
    # Seed 2 as a stopped benchmark leaves it: the runner's own command, stopped after 3 of 8 iterations.
    overrides = [*OVERRIDES, "train.seed=2", f"run.dir={where / 'seed2'}", "log.progress=false"]
    stopped = spmd_rl.train(CONFIG, [*overrides, "run.stop_after_iterations=3"])
    assert not stopped.finished and stopped.metrics["iteration"] == 2

    first = seed_runner(tmp_path, seeds=2)
    assert first.returncode == 0, first.stderr
    assert "seed 1: starting" in first.stdout and "seed 2: resuming" in first.stdout
    lines = (where / "seed2" / "metrics.jsonl").read_text().splitlines()
    iterations = [json.loads(line)["iteration"] for line in lines]
    assert iterations == list(range(8))  # resumed after iteration 2, nothing run twice
    for seed in (1, 2):
        assert (where / f"seed{seed}" / "finished.json").exists()
        assert json.loads((where / f"seed{seed}" / "versions.json").read_text())["torch"]
    results = (where / "results.md").read_text()
    assert "versions: python" in results and "| 2/2 " in results

    again = seed_runner(tmp_path, seeds=2)
    assert again.returncode == 0, again.stderr
    assert "seed 1: finished before, skipped" in again.stdout and "seed 2: finished before, skipped" in again.stdout

    # A fresh machine: the run directories are gone, the results files (git) are not.
    saved = {seed: json.loads((tmp_path / "results" / where.name / f"seed{seed}.json").read_text()) for seed in (1, 2)}
    assert saved[2]["env_steps"] == json.loads(lines[-1])["env_steps"] and saved[2]["versions"]["torch"]
    assert saved[2]["eval"] is not None and saved[2]["date"] and saved[2]["load_at_end"]
    shutil.rmtree(where)
    report = seed_runner(tmp_path, 2, "--report-only")
    assert report.returncode == 0 and "| 2/2 " in report.stdout, report.stdout
    fresh = seed_runner(tmp_path, seeds=3)
    assert fresh.returncode == 0, fresh.stderr
    assert "seed 1: finished before, skipped" in fresh.stdout and "seed 2: finished before, skipped" in fresh.stdout
    assert "seed 3: starting" in fresh.stdout and "| 3/3 " in fresh.stdout
