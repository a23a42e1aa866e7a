"""One writer per run directory: rank 0 holds an flock on `<run dir>/run.lock` from the moment it chose the
directory until its process ends the run. The kernel drops an flock when its holder dies (kill -9, a node's crash
as the file system sees it), so nothing stale is ever left to clean up; the file itself stays, holding the last
holder's host and pid, which is what a refused second copy names. When the run ends in an orderly way (done, a
checkpointed stop, an error it could report), its holder adds the time and the exit code before letting go, so
`python -m spmd_rl.runs` can tell a run that is running (the lock is held), stopped, failed or killed (the lock
is free and holds no exit code: kill -9, a lost node, a run from before exit codes were recorded).

A second copy of the same command (another terminal, a job submitted twice) is refused with one line rather than
given the next directory: the rerun-resumes rule (run/resume.py command_run_dir) needs one run per command at a
time, and a copy that went elsewhere would leave the user two half-runs of one command."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from pathlib import Path

from spmd_rl.persist.fileio import file_error
from spmd_rl.persist.run_files import LOCK_FILE
from spmd_rl.runtime.errors import UserError

_held: dict[Path, int] = {}  # run directory -> the descriptor whose flock this process holds


def lock_run_dir(run_dir: Path) -> None:
    """Take run_dir's lock for this process (until release_run_dirs), or raise a UserError naming its holder."""
    path = Path(run_dir) / LOCK_FILE
    key = Path(run_dir).resolve()
    if key in _held:
        return
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise file_error(path, exc, "cannot create the run directory's lock") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        raise UserError(
            f"run directory {run_dir} is in use by another run ({holder}); wait for it to end or stop it, or give "
            f"this one another run.dir (run.resume=never starts a new directory for the same command)"
        ) from None
    except OSError as exc:  # a file system without locks: say so rather than run unguarded without a word
        os.close(fd)
        raise file_error(path, exc, "cannot lock the run directory") from None
    holder = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}) + "\n"
    os.ftruncate(fd, 0)
    os.pwrite(fd, holder.encode(), 0)
    _held[key] = fd


def record_exit(exit_code: int) -> None:
    """Write how this run ends (exit_code) beside the holder in every run.lock this process holds, keeping the
    lock: called before the slow part of the exit (the process groups' teardown), so that a launcher's SIGKILL
    there (plain mpirun kills ranks a second after their SIGTERM) leaves the code written."""
    for fd in _held.values():
        with contextlib.suppress(OSError, ValueError):  # a record to read back, never a reason to fail an exit
            holder = json.loads(os.pread(fd, 4096, 0).decode())
            record = json.dumps({**holder, "ended": time.time(), "exit_code": exit_code}) + "\n"
            os.ftruncate(fd, 0)
            os.pwrite(fd, record.encode(), 0)


def release_run_dirs(exit_code: int | None = None) -> None:
    """Let go of every run directory this process locked (the end of a run; process exit does the same), first
    recording how it ended (exit_code; None: record nothing more) beside the holder."""
    if exit_code is not None:
        record_exit(exit_code)
    while _held:
        _, fd = _held.popitem()
        os.close(fd)  # closing the last descriptor of the open file drops its flock


def read_lock(run_dir: Path) -> tuple[bool, dict]:
    """(held, record): whether a process holds run_dir's lock now, and what the lock file says (host, pid, since,
    and once it ended: ended, exit_code); ({} when absent or unreadable). A shared lock taken for a moment tells
    whether an exclusive one is held, without writing anything."""
    try:
        fd = os.open(Path(run_dir) / LOCK_FILE, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False, {}
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            held = False
        except BlockingIOError:
            held = True
        except OSError:  # a file system without locks: nothing to tell
            held = False
        try:
            record = json.loads(os.pread(fd, 4096, 0).decode())
        except (OSError, ValueError):
            record = {}
        return held, record if isinstance(record, dict) else {}
    finally:
        os.close(fd)  # drops the shared lock too


def _holder(fd: int) -> str:
    """'host H, pid P' from the lock file's content, as its holder wrote it."""
    try:
        holder = json.loads(os.pread(fd, 4096, 0).decode())
        return f"host {holder['host']}, pid {holder['pid']}"
    except (OSError, ValueError, KeyError, TypeError):  # the holder has not written it yet
        return "host and pid not yet written"
