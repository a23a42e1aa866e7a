"""One writer per run directory: rank 0 holds an flock on `<run dir>/run.lock` from the moment it chose the
directory until its process ends the run. The kernel drops an flock when its holder dies (kill -9, a node's crash
as the file system sees it), so nothing stale is ever left to clean up; the file itself stays, holding the last
holder's host and pid, which is what a refused second copy names.

A second copy of the same command (another terminal, a job submitted twice) is refused with one line rather than
given the next directory: the rerun-resumes rule (run/resume.py command_run_dir) needs one run per command at a
time, and a copy that went elsewhere would leave the user two half-runs of one command."""

from __future__ import annotations

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


def release_run_dirs() -> None:
    """Let go of every run directory this process locked (the end of a run; process exit does the same)."""
    while _held:
        _, fd = _held.popitem()
        os.close(fd)  # closing the last descriptor of the open file drops its flock


def _holder(fd: int) -> str:
    """'host H, pid P' from the lock file's content, as its holder wrote it."""
    try:
        holder = json.loads(os.pread(fd, 4096, 0).decode())
        return f"host {holder['host']}, pid {holder['pid']}"
    except (OSError, ValueError, KeyError, TypeError):  # the holder has not written it yet
        return "host and pid not yet written"
