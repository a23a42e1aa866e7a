"""The worker processes of env.vectorization=async: one that dies (SIGKILL, as the out-of-memory killer sends it)
ends its run within the bound with one line naming it, not a wait forever in the envs' close; a Ctrl-C to the
whole process group leaves workers started by spawn alive until their rank has stopped with its checkpoint; an env
that raises in a worker is the rank's one line, without gymnasium's report of the worker's traceback."""

import os
import signal
import subprocess
import sys
import time

import pytest
from harness.launch import ROOT, job_env, with_pythonpath
from harness.runs import TINY, run_main


@pytest.mark.parametrize(("fault", "end"), [("kill", "(killed by SIGKILL)"), ("os_exit", "(exit code 7)")])
def test_an_env_worker_that_ends_mid_step_ends_the_run_with_one_line_naming_it(tmp_path, fault, end):
    result = run_main(
        "--config", TINY, f"run.dir={tmp_path / 'run'}", "env.id=tests.harness.faulty_env:Faulty-v0",
        f"env.kwargs={{fault: {fault}, rank: -1, after: 20}}", "env.vectorization=async", "train.total_steps=9999999",
        timeout=180,
    )  # fmt: skip
    assert result.returncode == 4, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("spmd_rl: error in user code")]
    assert len(lines) == 1 and f"{end} during step 21" in lines[0], result.stderr[-3000:]
    assert "env worker process" in lines[0] and "EOFError" not in lines[0]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]


def test_ctrl_c_to_the_process_group_stops_a_run_with_spawned_env_workers_with_its_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    run = subprocess.Popen(
        [
            sys.executable, "-m", "spmd_rl.main", "--config", TINY, f"run.dir={run_dir}", "train.total_steps=9999999",
            "env.vectorization=async", "env.start_method=spawn", "checkpoint.every_iterations=1000",
        ],
        cwd=tmp_path,
        env=with_pythonpath(job_env(), ROOT),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a terminal's foreground job
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 150
        while not (run_dir / "metrics.jsonl").exists() or not (run_dir / "metrics.jsonl").read_text().strip():
            assert run.poll() is None and time.monotonic() < deadline, run.communicate()
            time.sleep(0.1)
        os.killpg(run.pid, signal.SIGINT)  # the terminal's Ctrl-C: the rank and its workers
        stdout, stderr = run.communicate(timeout=120)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.communicate()
    assert run.returncode == 75, stderr[-3000:]
    assert "stopped by SIGINT after iteration" in stderr and "Traceback" not in stderr, stderr[-3000:]
    assert [line for line in stderr.splitlines() if "SIGINT: stopping" in line] == [
        "spmd_rl: SIGINT: stopping after this iteration with a checkpoint (send it again to stop at once)"
    ], stderr[-3000:]


def test_an_env_that_raises_in_a_worker_is_one_line_without_the_workers_traceback(tmp_path):
    result = run_main(
        "--config", TINY, f"run.dir={tmp_path / 'run'}", "env.id=tests.harness.faulty_env:Faulty-v0",
        "env.kwargs={fault: raise, rank: -1, after: 20}", "env.vectorization=async",
    )  # fmt: skip
    assert result.returncode == 4, result.stderr[-3000:]
    assert "raised at step 21: ValueError: Faulty-v0: deliberate failure after 20 steps" in result.stderr
    assert "Traceback" not in result.stderr and "UserWarning" not in result.stderr, result.stderr[-3000:]
