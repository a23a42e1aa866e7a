"""One writer per run directory: a second copy of a running command is refused with one line naming the holder
(host, pid), on every rank by rank 0's decision; a holder killed with -9 leaves no stale lock."""

import json
import signal
import socket
import subprocess
import sys
import time

import pytest
from harness.launch import job_env as _env
from harness.multiproc import assert_all_ok, run_ranks
from harness.parts import gloo_runtime as _runtime
from harness.runs import TINY

from spmd_rl.config.loading import load_config
from spmd_rl.persist import run_lock
from spmd_rl.persist.run_lock import lock_run_dir, release_run_dirs
from spmd_rl.run.resume import agree_on_run
from spmd_rl.runtime.errors import SharedUserError


def _start(cwd, *overrides) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "spmd_rl.main", "--config", TINY, *overrides]
    return subprocess.Popen(cmd, cwd=cwd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_a_second_copy_of_a_running_command_is_refused_and_kill_9_leaves_no_stale_lock(tmp_path):
    first = _start(tmp_path, "train.total_steps=4000000")
    deadline = time.monotonic() + 90
    while not list(tmp_path.glob("runs/*/metrics.jsonl")):
        assert time.monotonic() < deadline and first.poll() is None, "the first copy did not start"
        time.sleep(0.1)
    try:
        second = _start(tmp_path, "train.total_steps=4000000")
        _, stderr = second.communicate(timeout=90)
        assert second.returncode == 2, stderr
        run_dir = next(tmp_path.glob("runs/*"))
        assert stderr.strip().splitlines() == [
            f"spmd_rl: rank 0: error: run directory {run_dir.relative_to(tmp_path)} is in use by another run (host "
            f"{socket.gethostname()}, pid {first.pid}); wait for it to end or stop it, or give this one another "
            f"run.dir (run.resume=never starts a new directory for the same command)"
        ]
        assert first.poll() is None, "the first copy runs on"
        iterations = [json.loads(line)["iteration"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert iterations == list(range(len(iterations))), "one writer: no interleaved lines"
    finally:
        first.send_signal(signal.SIGKILL)
        first.communicate(timeout=30)
    third = _start(tmp_path, "train.total_steps=4000000", "run.stop_after_iterations=2")
    _, stderr = third.communicate(timeout=120)
    assert third.returncode == 75, stderr
    assert len(list(tmp_path.glob("runs/*"))) == 1, "the same command continued in its own directory"


def _agree_while_held(rank, world_size, run_dir):
    run_lock._held.clear()  # a forked rank is another process: the lock the parent took is not its own
    cfg = load_config(None, [f"run.dir={run_dir}" if rank == 0 else "run.dir=/elsewhere"])
    with pytest.raises(SharedUserError, match=r"is in use by another run \(host .+, pid \d+\)"):
        agree_on_run(cfg, _runtime(rank, world_size))


def test_every_rank_follows_rank_0s_refusal(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    lock_run_dir(run_dir)  # this process holds it; the forked ranks open the file afresh and cannot take it
    try:
        assert_all_ok(run_ranks(_agree_while_held, 2, str(run_dir), timeout_s=20))
    finally:
        release_run_dirs()
    assert not (run_dir / "config.yaml").exists(), "the refused run wrote nothing"
