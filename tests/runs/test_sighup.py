"""SIGHUP (the terminal closed, the ssh session dropped) stops a run as SIGTERM does: the iteration ends, a
checkpoint is saved, one line, exit 75. A run started with SIGHUP ignored (`nohup`) keeps ignoring it. On a real
terminal that hangs up, the run's writes to it would fail (EIO): the stop still ends in its checkpoint and exit 75."""

import json
import os
import pty
import select
import signal
import subprocess
import sys
import time

import pytest
from harness.launch import ROOT, job_env, with_pythonpath
from harness.runs import TINY


def _ignoring_sighup() -> None:
    signal.signal(signal.SIGHUP, signal.SIG_IGN)


def _sighup_at_its_default() -> None:
    # As a terminal's shell starts a command. A suite started under nohup (a background CI run) would otherwise pass
    # SIGHUP on ignored, and every run here would rightly keep ignoring it (2026-12-07: both cases timed out so).
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


def _command(run_dir, *overrides: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "spmd_rl.main",
        "--config",
        TINY,
        f"run.dir={run_dir}",
        "train.total_steps=9999999",
        *overrides,
    ]


def _start(
    run_dir, preexec_fn=_sighup_at_its_default, output=subprocess.PIPE, new_session=False, overrides=()
) -> subprocess.Popen:
    return subprocess.Popen(
        _command(run_dir, *overrides),
        cwd=run_dir.parent,
        env=with_pythonpath(job_env(), ROOT),
        stdout=output,
        stderr=output,
        text=True,
        preexec_fn=preexec_fn,
        start_new_session=new_session,
    )


def test_sighup_stops_with_a_checkpoint_unless_it_was_ignored_at_start(tmp_path):
    hung_up, nohup = _start(tmp_path / "hung_up"), _start(tmp_path / "nohup", _ignoring_sighup)
    try:
        deadline = time.monotonic() + 120
        while not all((tmp_path / name / "metrics.jsonl").exists() for name in ("hung_up", "nohup")):
            assert hung_up.poll() is None and nohup.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        hung_up.send_signal(signal.SIGHUP)
        nohup.send_signal(signal.SIGHUP)
        _, stderr = hung_up.communicate(timeout=120)
        assert nohup.poll() is None, "SIGHUP stopped a run that was started with it ignored"
        nohup.send_signal(signal.SIGTERM)
        _, nohup_stderr = nohup.communicate(timeout=120)
    finally:
        for run in (hung_up, nohup):
            if run.poll() is None:
                run.kill()
                run.communicate()
    assert hung_up.returncode == 75, stderr
    assert "Traceback" not in stderr, stderr
    stop = [line for line in stderr.splitlines() if "stopped by SIGHUP after iteration" in line]
    assert len(stop) == 1, stderr
    checkpoint = stop[0].split("checkpoint ")[1].split(";")[0]
    assert (tmp_path / checkpoint / "COMPLETE").is_file(), stop[0]
    assert nohup.returncode == 75 and "stopped by SIGTERM" in nohup_stderr, nohup_stderr


def test_a_run_on_a_terminal_that_hangs_up_stops_with_its_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    argv, env = _command(run_dir), with_pythonpath(job_env(), ROOT)
    pid, terminal = pty.fork()  # the child's own session, with the pty as its controlling terminal (an ssh login's)
    if pid == 0:
        os.chdir(tmp_path)
        _sighup_at_its_default()
        os.execve(argv[0], argv, env)
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "metrics.jsonl").exists():  # read what it writes, so that it never blocks on the pty
            assert time.monotonic() < deadline, "the run did not start"
            if select.select([terminal], [], [], 0.1)[0]:
                os.read(terminal, 1 << 16)
    finally:
        os.close(terminal)  # the terminal goes away: the kernel sends SIGHUP to the session
    waited = time.monotonic() + 120
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < waited:
        time.sleep(0.1)
    if done[0] == 0:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        raise AssertionError("the run went on after its terminal hung up")
    assert os.waitstatus_to_exitcode(done[1]) == 75
    assert json.loads((run_dir / "run.lock").read_text())["exit_code"] == 75
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    assert (run_dir / "checkpoints" / latest / "COMPLETE").is_file()


def _records(run_dir) -> int:
    return len((run_dir / "metrics.jsonl").read_text().splitlines())


@pytest.mark.parametrize("iterations_after_hangup", [0, 5])
def test_a_run_whose_terminal_went_away_trains_on_and_stops_with_75(tmp_path, iterations_after_hangup):
    """The rank's terminal hung up, but no SIGHUP reaches it (a launcher that got the SIGHUP passes on SIGTERM; or its
    launcher's terminal, not its own, went away). 0: SIGTERM at once; the stop's lines cannot be written, the stop
    still ends in its checkpoint, exit 75 and run.lock's 75. 5: every progress line after the hangup is a line
    printed before any handler ran, which ended the run with EIO, exit 1: the run trains on, then stops as in 0."""
    run_dir = tmp_path / "run"
    terminal, its_end = os.openpty()
    # not its controlling terminal: no SIGHUP from the kernel; a progress line after every iteration
    run = _start(run_dir, output=its_end, new_session=True, overrides=("log.interval_s=0",))
    os.close(its_end)
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "metrics.jsonl").exists():
            assert run.poll() is None and time.monotonic() < deadline, "the run did not start"
            if select.select([terminal], [], [], 0.1)[0]:
                os.read(terminal, 1 << 16)
        os.close(terminal)  # hung up: the run's writes to it fail from here on
        terminal = -1
        hung_up_at = _records(run_dir)
        while _records(run_dir) < hung_up_at + iterations_after_hangup:
            assert run.poll() is None, f"the run ended (exit {run.returncode}) after its terminal hung up"
            assert time.monotonic() < deadline, "the run made no progress after its terminal hung up"
            time.sleep(0.1)
        run.send_signal(signal.SIGTERM)
        run.wait(timeout=120)
    finally:
        if terminal >= 0:
            os.close(terminal)
        if run.poll() is None:
            run.kill()
            run.wait()
    assert run.returncode == 75
    assert json.loads((run_dir / "run.lock").read_text())["exit_code"] == 75
