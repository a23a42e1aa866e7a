"""A run started with SIGINT ignored (a background job, `cmd &`, of a script: its shell meant it to outlive the
terminal's Ctrl-C) keeps ignoring it and says so at start in one line, naming the signal that does stop it."""

import signal
import subprocess
import sys
import time

from harness.launch import ROOT, job_env, with_pythonpath
from harness.runs import TINY


def _ignoring_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def test_a_run_started_with_sigint_ignored_says_so_and_stops_on_sigterm(tmp_path):
    run = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "spmd_rl.main",
            "--config",
            TINY,
            f"run.dir={tmp_path / 'run'}",
            "train.total_steps=9999999",
        ],
        cwd=tmp_path,
        env=with_pythonpath(job_env(), ROOT),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_ignoring_sigint,
    )
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "run" / "metrics.jsonl").exists():
            assert run.poll() is None and time.monotonic() < deadline, run.communicate()
            time.sleep(0.1)
        run.send_signal(signal.SIGINT)
        time.sleep(3)
        assert run.poll() is None, "SIGINT stopped a run that was started with it ignored"
        run.send_signal(signal.SIGTERM)
        stdout, stderr = run.communicate(timeout=120)
    finally:
        if run.poll() is None:
            run.kill()
            run.communicate()
    assert run.returncode == 75, stderr
    notes = [line for line in stdout.splitlines() if "SIGINT ignored" in line]
    assert notes == [
        f"spmd_rl: note: this run was started with SIGINT ignored (a background job of a script, `cmd &`): Ctrl-C "
        f"will not reach it; stop it with SIGTERM (kill -TERM {run.pid}), which saves a checkpoint"
    ], stdout
    assert stdout.splitlines()[0] == notes[0], "said at start"
    assert "stopped by SIGTERM" in stderr


def test_a_run_started_normally_says_nothing_of_sigint(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "spmd_rl.main", "--config", TINY, f"run.dir={tmp_path / 'run'}", "train.total_steps=64"],
        cwd=tmp_path,
        env=with_pythonpath(job_env(), ROOT),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "SIGINT" not in result.stdout + result.stderr
