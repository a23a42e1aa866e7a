"""One writer per run directory: a second copy of a running command is refused with one line naming the holder
(host, pid), on every rank by rank 0's decision; a holder killed with -9 leaves no stale lock."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from harness.launch import job_env as _env
from harness.multiproc import assert_all_ok, run_ranks
from harness.parts import gloo_runtime as _runtime
from harness.runs import TINY

from spmd_rl.config.loading import load_config
from spmd_rl.persist import run_lock
from spmd_rl.persist.run_lock import lock_run_dir, read_lock, release_run_dirs
from spmd_rl.run.resume import agree_on_run
from spmd_rl.runtime.errors import SharedUserError, UserError


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
            f"spmd_rl: error: run directory {run_dir.relative_to(tmp_path)} is in use by another run (host "
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
    # run.dir named: no run.resume=never hint, which only picks a new directory for a command's own (pass 4, M2)
    held = r"another run \(host .+, pid \d+\); wait for it to end or stop it, or give this one another run.dir$"
    with pytest.raises(SharedUserError, match=held):
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


def _try_lock_in_another_process(run_dir) -> subprocess.CompletedProcess:
    script = (
        "import sys\nfrom spmd_rl.persist.run_lock import lock_run_dir\nfrom spmd_rl.runtime.errors import UserError\n"
        "try:\n    lock_run_dir(sys.argv[1])\nexcept UserError as exc:\n    print(exc)\n    sys.exit(2)\n"
    )
    return subprocess.run([sys.executable, "-c", script, str(run_dir)], capture_output=True, text=True, timeout=60)


def test_removing_run_lock_does_not_let_a_second_copy_in(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    lock_run_dir(run_dir)
    try:
        (run_dir / "run.lock").unlink()  # what people do with a lock they think stale
        second = _try_lock_in_another_process(run_dir)
        assert second.returncode == 2, second
        assert "is in use by another run" in second.stdout, second
    finally:
        release_run_dirs()
    assert _try_lock_in_another_process(run_dir).returncode == 0, "free again once its holder let go"


def test_a_refused_start_leaves_an_absent_run_lock_absent(tmp_path):
    run_dir = tmp_path / "run"  # a stopped run whose run.lock was removed (`rm run.lock`)
    run_dir.mkdir()
    lock_run_dir(run_dir)
    release_run_dirs(2)  # refused (another config) before it owned the directory (own_run_dirs)
    assert not (run_dir / "run.lock").exists(), "a refused start made a run.lock where there was none"


def test_a_run_lock_removed_while_running_gets_the_exit_code_at_its_name(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    lock_run_dir(run_dir)
    run_lock.own_run_dirs()  # the run's first checkpoint
    (run_dir / "run.lock").unlink()  # `rm run.lock` while it runs
    release_run_dirs(75)
    held, note = read_lock(run_dir)
    assert not held and note["exit_code"] == 75 and note["pid"] == os.getpid(), note


@pytest.mark.parametrize("kind", ["symlink", "fifo", "directory", "hard link"])
def test_a_run_lock_that_is_not_a_regular_file_of_one_link_is_refused_and_left_alone(tmp_path, kind):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    lock = run_dir / "run.lock"
    precious = tmp_path / "precious.txt"
    precious.write_text("the user's data\n")
    make = {"symlink": lock.symlink_to, "fifo": lambda _: os.mkfifo(lock), "directory": lambda _: lock.mkdir()}
    make.get(kind, lock.hardlink_to)(precious)
    with pytest.raises(UserError, match=r"run\.lock (is not a regular file|has 2 hard links).*remove it"):
        lock_run_dir(run_dir)
    assert not run_lock._held, "a refused lock is let go"
    assert precious.read_text() == "the user's data\n"
    reading = threading.Thread(target=read_lock, args=(run_dir,), daemon=True)  # the runs index: no hang either
    reading.start()
    reading.join(10)
    assert not reading.is_alive(), "read_lock hangs on it"
    assert read_lock(run_dir) == (False, {})


def test_a_run_directory_removed_and_made_again_while_its_run_goes_on_lets_no_second_copy_in(tmp_path):
    """`rm -rf` of a running run's directory took both flocks' files with it: a second copy made the directory
    again, took fresh locks and wrote beside the first (fault pass 8). The path itself is held."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    lock_run_dir(run_dir)
    try:
        shutil.rmtree(run_dir)
        run_dir.mkdir()
        second = _try_lock_in_another_process(run_dir)
        assert second.returncode == 2, second
        assert f"is in use by another run (this host, pid {os.getpid()}), whose directory was removed" in second.stdout
        assert not (run_dir / "run.lock").exists(), "the refused start made no note"
    finally:
        release_run_dirs()
    assert _try_lock_in_another_process(run_dir).returncode == 0, "free again once its holder let go"
