"""Honest numbers across a stop and a resume, as a user sees them on the console and in metrics.jsonl: one
iteration numbering (from 0) in the console, metrics.jsonl, the checkpoint, the stop line and the resume line;
sps and wall_s count this process's steps and time only, so a resumed run's speed is its own."""

from __future__ import annotations

import re

import pytest
from harness.runs import TINY, read_metrics, run_main

STEPS_PER_ITERATION = 32  # ci_tiny in one process: 2 envs x 16 steps


def console_iterations(stdout: str) -> list[int]:
    return [int(n) for n in re.findall(r"^iter +(\d+) ", stdout, re.MULTILINE)]


def test_stop_and_resume_agree_on_iterations_and_the_resumed_speed_is_its_own(tmp_path):
    run_dir = tmp_path / "run"
    args = ["--config", TINY, f"run.dir={run_dir}", "log.interval_s=0"]  # a console line every iteration

    stopped = run_main(*args, "run.stop_after_iterations=3")
    assert stopped.returncode == 75, stopped.stderr[-3000:]
    # Three iterations ran: 0, 1 and 2, everywhere.
    assert console_iterations(stopped.stdout) == [0, 1, 2]
    assert [r["iteration"] for r in read_metrics(run_dir)] == [0, 1, 2]
    checkpoint = run_dir / "checkpoints" / "iter_000000002"
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == checkpoint.name
    assert (
        f"spmd_rl: stopped by run.stop_after_iterations=3 after iteration 2; checkpoint {checkpoint}; "
        "rerun the same command to resume" in stopped.stderr
    ), stopped.stderr

    resumed = run_main(*args, "run.stop_after_iterations=3")  # the same command again: its stop is behind it
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert (
        "spmd_rl: note: run.stop_after_iterations=3 is behind this resume (next: iteration 3): it does not stop this "
        "run, which goes on to its end; set it to 4 or more to stop it again\n" in resumed.stdout
    ), resumed.stdout
    assert f"resuming from {checkpoint} after iteration 2 (next: iteration 3 of 0..7)" in resumed.stdout
    assert console_iterations(resumed.stdout) == [3, 4, 5, 6, 7]
    records = read_metrics(run_dir)
    assert [r["iteration"] for r in records] == list(range(8))

    resumed_steps = 3 * STEPS_PER_ITERATION  # taken before the resume
    for record in records[3:]:
        assert record["env_steps"] == (record["iteration"] + 1) * STEPS_PER_ITERATION  # the run's total
        # sps is this process's steps over this process's time (wall_s), not the run's steps over it
        assert record["sps"] * record["wall_s"] == pytest.approx(record["env_steps"] - resumed_steps)
    first = records[3]
    assert first["sps"] * first["wall_s"] == pytest.approx(STEPS_PER_ITERATION)
    done = re.search(
        r"^done: 256 env steps, 160 of them since the resume in [\d.]+s \(\d+ steps/s\)", resumed.stdout, re.M
    )
    assert done, resumed.stdout


def test_a_run_in_one_go_reports_its_speed_over_all_its_steps(tmp_path):
    result = run_main("--config", TINY, f"run.dir={tmp_path}")
    assert result.returncode == 0, result.stderr[-3000:]
    last = read_metrics(tmp_path)[-1]
    assert last["sps"] * last["wall_s"] == pytest.approx(last["env_steps"])
    assert re.search(r"^done: 256 env steps in [\d.]+s \(\d+ steps/s\)", result.stdout, re.M), result.stdout
