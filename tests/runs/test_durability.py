"""Durability: what kill -9, a stop signal, a full disk or a read-only directory leave behind, in real processes.

- kill -9 while appending to an experience log: the file opens, every row present is intact, and every row appended
  more than flush_every_s before the writer's last append is there.
- SIGTERM / SIGUSR1 / SIGINT: the exception unwinds to a finally-block whose flush_open_files writes every staged row.
- a full disk (RLIMIT_FSIZE in a child, or a tiny tmpfs where mounting is allowed): metrics lines are never torn, a
  file replaced atomically keeps its old content, and each failure is one UserError naming the path.
- a read-only run directory: a UserError naming the path, before anything is written.
- broadcast_text between two real gloo ranks.
"""

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch
from harness.multiproc import assert_all_ok, run_ranks

from spmd_rl.persist.fileio import LineAppender, make_dirs, write_atomic
from spmd_rl.run.metrics import MetricsLogger
from spmd_rl.runtime.errors import UserError
from spmd_rl.storage.reader import HDF5Reader
from spmd_rl.storage.writer import HDF5Writer

PYTHON = sys.executable
ROWS_PER_APPEND = 8  # a rollout of 4 steps x 2 envs

# Row r of the log holds r in every key (and env_step r), so a torn, missing or misplaced row shows.
ROLLOUT = """
import torch
from tensordict import TensorDict

def rollout(first):
    ids = torch.arange(first, first + 8).reshape(4, 2)
    return TensorDict({"id": ids, "obs": ids[..., None].float().expand(4, 2, 3).clone()}, batch_size=[4, 2])
"""

APPEND_UNTIL_KILLED = ROLLOUT + textwrap.dedent("""
    import random, sys, time
    from spmd_rl.storage.experience_log import ExperienceLog
    log = ExperienceLog(sys.argv[1], 0, rollout(0), flush_every_s=float(sys.argv[2]))
    pause = random.Random(int(sys.argv[3]))
    rows = 0
    while True:  # a stage holds ~80k rows here: only the time bound writes anything before the kill
        started = time.monotonic()
        log.append(rollout(rows), policy_version=0, env_step=rows)
        rows += 8
        print(started, time.monotonic(), rows, flush=True)
        time.sleep(pause.uniform(0, 0.02))
""")


def read_log(run_dir) -> dict:
    with HDF5Reader(run_dir / "buffer" / "experience_rank0.h5") as reader:
        return reader.read(meta=True)


def assert_rows_intact(arrays: dict) -> int:
    rows = len(arrays["id"])
    np.testing.assert_array_equal(arrays["id"], np.arange(rows))
    np.testing.assert_array_equal(arrays["obs"], np.repeat(np.arange(rows, dtype=np.float32)[:, None], 3, 1))
    np.testing.assert_array_equal(arrays["meta/env_step"], np.arange(rows))
    return rows


@pytest.mark.parametrize("trial", range(3))
def test_kill_9_loses_at_most_flush_every_s_of_rows(tmp_path, trial):
    flush_every_s = 0.5
    child = subprocess.Popen(
        [PYTHON, "-c", APPEND_UNTIL_KILLED, str(tmp_path), str(flush_every_s), str(trial)],
        stdout=subprocess.PIPE,
        text=True,
    )
    appends = []  # (monotonic time the append started, when it returned, rows appended after it)
    try:
        line = child.stdout.readline()  # the writer is appending
        assert line, "the writer died before its first append"
        appends.append(tuple(float(x) for x in line.split()))
        kill_at = time.monotonic() + random.Random(trial).uniform(1.0, 2.5)
        while time.monotonic() < kill_at and (line := child.stdout.readline()):
            appends.append(tuple(float(x) for x in line.split()))
    finally:
        child.kill()
        child.wait(10)
    appends += [tuple(float(x) for x in line.split()) for line in child.stdout]
    assert child.returncode == -signal.SIGKILL

    present = assert_rows_intact(read_log(tmp_path))
    # The append that started last checked the clock after it started: every row appended (returned) more than
    # flush_every_s before that had waited long enough to be written by it or earlier.
    last_started = appends[-1][0]
    due = max((rows for _, returned, rows in appends if returned <= last_started - flush_every_s), default=0)
    appended = int(appends[-1][2])
    assert due > 0, "the writer ran too briefly for the time bound to write anything"
    assert due <= present <= appended + ROWS_PER_APPEND  # at most one append was killed before it printed
    print(f"kill -9 after {appended} rows: {present} on disk, {appended - present} lost")


STOPPED_BY_SIGNAL = ROLLOUT + textwrap.dedent("""
    import sys, time
    from spmd_rl.runtime.errors import StopSignal
    from spmd_rl.persist.fileio import flush_open_files
    from spmd_rl.runtime.signals import install_signal_handlers
    from spmd_rl.storage.experience_log import ExperienceLog
    install_signal_handlers()
    log = ExperienceLog(sys.argv[1], 0, rollout(0), flush_every_s=float("inf"))  # only a flush writes
    rows = 0
    try:
        while True:
            log.append(rollout(rows), policy_version=0, env_step=rows)
            rows += 8
            print(rows, flush=True)
            time.sleep(0.002)
    except StopSignal as stop:
        sys.exit(128 + stop.signal_number)
    except KeyboardInterrupt:
        sys.exit(130)
    finally:
        flush_open_files()
""")


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1, signal.SIGINT])
def test_a_stop_signal_flushes_every_staged_row(tmp_path, signum):
    child = subprocess.Popen([PYTHON, "-c", STOPPED_BY_SIGNAL, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        printed = [int(child.stdout.readline() or 0) for _ in range(50)]
        assert printed[-1] == 50 * ROWS_PER_APPEND, "the writer did not get going"
        child.send_signal(signum)
        out, _ = child.communicate(timeout=60)
    finally:
        child.kill()
        child.wait()
    assert child.returncode == 128 + signum
    appended = int(out.split()[-1]) if out.split() else printed[-1]
    present = assert_rows_intact(read_log(tmp_path))
    # An append is never cut by the signal (it is raised when the append ends): whole appends only, all written.
    assert present in (appended, appended + ROWS_PER_APPEND)


def test_signals_wait_for_the_end_of_a_deferred_section():
    from spmd_rl.runtime.errors import StopSignal
    from spmd_rl.runtime.signals import install_signal_handlers, signals_deferred

    previous = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    install_signal_handlers()
    try:
        finished = False
        with pytest.raises(StopSignal, match="SIGUSR1"):
            with signals_deferred():
                os.kill(os.getpid(), signal.SIGUSR1)
                time.sleep(0.05)  # the handler runs here and holds the signal back
                finished = True
        assert finished
        with pytest.raises(ValueError):  # an error inside the section wins; the signal is dropped
            with signals_deferred():
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.05)
                raise ValueError("the section's own error")
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


# -- full disk -------------------------------------------------------------------------------------------------

FILL_THE_DISK = textwrap.dedent("""
    import json, resource, sys, torch
    from pathlib import Path
    from tensordict import TensorDict
    from spmd_rl.runtime.errors import UserError
    from spmd_rl.persist.fileio import LineAppender, flush_open_files, torch_save_atomic, write_atomic
    from spmd_rl.storage.writer import HDF5Writer
    run = Path(sys.argv[1])
    if len(sys.argv) > 2:  # a file size limit stands in for a full disk: writes past it fail with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[2]),) * 2)
    write_atomic(run / "config.yaml", "old: 1\\n")
    torch_save_atomic({"weights": torch.ones(3)}, run / "policy.pt")
    # An experience file with rows staged in memory, to be written when the disk is full.
    writer = HDF5Writer(run / "buffer" / "experience_rank0.h5", {"id": ((), "int64")}, flush_every_s=float("inf"))
    writer.append({"id": torch.arange(10_000)})
    metrics = LineAppender(run / "metrics.jsonl")
    try:
        for i in range(100_000):
            metrics.append(json.dumps({"iteration": i, "padding": "x" * 90}))
    except UserError as error:
        print(error, flush=True)
    for replace in (lambda: write_atomic(run / "config.yaml", "new: 1\\n" * 40_000),
                    lambda: torch_save_atomic({"weights": torch.ones(40_000)}, run / "policy.pt")):
        try:
            replace()
        except UserError as error:
            print(error, flush=True)
    flush_open_files()  # cannot write the staged rows: says so in one line and returns
    print("flush_open_files returned", flush=True)
""")


def check_full_disk_run(run_dir, result, cause: str) -> None:
    assert result.returncode == 0, result.stderr
    errors = result.stdout.strip().splitlines()
    assert errors[-1] == "flush_open_files returned"
    for name, line in zip(("metrics.jsonl", "config.yaml", "policy.pt"), errors):
        assert line.startswith(f"{run_dir / name}: cannot write: {cause}"), line
    lines = (run_dir / "metrics.jsonl").read_bytes().split(b"\n")
    assert lines[-1] == b"" and len(lines) > 2  # ends with a whole line
    assert [json.loads(line)["iteration"] for line in lines[:-1]] == list(range(len(lines) - 1))
    assert (run_dir / "config.yaml").read_text() == "old: 1\n"  # the old file, whole
    assert torch.equal(torch.load(run_dir / "policy.pt")["weights"], torch.ones(3))
    assert sorted(path.name for path in run_dir.iterdir()) == [
        "buffer",
        "config.yaml",
        "metrics.jsonl",
        "policy.pt",
    ]  # no temporary file left
    flush_lines = [line for line in result.stderr.splitlines() if "experience_rank0.h5" in line]
    assert len(flush_lines) == 1, result.stderr
    assert flush_lines[0].startswith(
        f"spmd_rl: error: {run_dir / 'buffer' / 'experience_rank0.h5'}: cannot write rows: {cause}"
    ), flush_lines


def test_a_file_size_limit_never_tears_a_line_or_a_file(tmp_path):
    result = subprocess.run(
        [PYTHON, "-c", FILL_THE_DISK, str(tmp_path), "60000"], capture_output=True, text=True, timeout=120
    )
    check_full_disk_run(tmp_path, result, "file size limit reached")


@contextlib.contextmanager
def tmpfs(path, options: str):
    """A real tmpfs mounted at path (needs root); skips the test where mounting is not allowed."""
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


def test_a_full_disk_never_tears_a_line_or_a_file(tmp_path):
    with tmpfs(tmp_path / "small", "size=256k") as run_dir:
        result = subprocess.run(
            [PYTHON, "-c", FILL_THE_DISK, str(run_dir)], capture_output=True, text=True, timeout=120
        )
        check_full_disk_run(run_dir, result, "disk full")


@pytest.fixture
def read_only_dir(tmp_path):
    if os.geteuid() != 0:  # permissions hold for everyone but root
        path = tmp_path / "read_only"
        path.mkdir(mode=0o555)
        yield path
        path.chmod(0o755)
        return
    with tmpfs(tmp_path / "read_only", "ro,size=64k") as path:
        yield path


def test_a_read_only_run_directory_is_a_user_error_naming_the_path(read_only_dir):
    with pytest.raises(UserError, match=f"^{read_only_dir / 'run'}: cannot create the directory: "):
        make_dirs(read_only_dir / "run")
    with pytest.raises(UserError, match=f"^{read_only_dir / 'metrics.jsonl'}: cannot open for appending: "):
        MetricsLogger(read_only_dir, 100, progress=False, interval_s=1.0, tensorboard=False)
    with pytest.raises(UserError, match=f"^{read_only_dir / 'config.yaml'}: cannot write: "):
        write_atomic(read_only_dir / "config.yaml", "a: 1\n")
    with pytest.raises(UserError, match=f"^{read_only_dir / 'buffer'}: cannot create the directory: "):
        HDF5Writer(read_only_dir / "buffer" / "experience_rank0.h5", {"id": ((), "int64")})
    with pytest.raises(UserError, match=f"^{read_only_dir / 'replay.h5'}: cannot create the file: "):
        HDF5Writer(read_only_dir / "replay.h5", {"id": ((), "int64")})


def test_a_file_where_the_run_directory_should_be_is_a_user_error(tmp_path):
    (tmp_path / "run").write_text("not a directory")
    with pytest.raises(UserError, match=f"^{tmp_path / 'run'}: cannot create the directory: a file stands where"):
        make_dirs(tmp_path / "run")
    with pytest.raises(UserError, match=f"^{tmp_path / 'run' / 'metrics.jsonl'}: cannot open for appending: "):
        LineAppender(tmp_path / "run" / "metrics.jsonl")


def test_write_atomic_replaces_whole_files(tmp_path):
    write_atomic(tmp_path / "config.yaml", "a: 1\n")
    write_atomic(tmp_path / "config.yaml", b"b: 2\n")
    assert (tmp_path / "config.yaml").read_text() == "b: 2\n"
    assert [path.name for path in tmp_path.iterdir()] == ["config.yaml"]


# -- no pickle on the wire -------------------------------------------------------------------------------------


def broadcast_texts(rank: int, world_size: int) -> None:
    from spmd_rl.runtime.distributed import broadcast_text

    text = "runs/ppo-été-20261130-120000 ✓" if rank == 1 else ""
    assert broadcast_text(text, src=1) == "runs/ppo-été-20261130-120000 ✓"
    assert broadcast_text("", src=0) == ""
    with pytest.raises(UserError, match="longer than 16 bytes"):  # on every rank, so none is left waiting
        broadcast_text("x" * 17 if rank == 0 else "", src=0, max_bytes=16)
    assert broadcast_text("after" if rank == 0 else "", src=0, max_bytes=16) == "after"


def test_broadcast_text_between_two_gloo_ranks():
    assert_all_ok(run_ranks(broadcast_texts, 2, timeout_s=30))
