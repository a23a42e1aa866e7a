"""One writer per run directory: rank 0 holds an flock on the run directory itself from the moment it chose the
directory until its process ends the run. The kernel drops an flock when its holder dies (kill -9, a node's crash
as the file system sees it), so nothing stale is ever left to clean up, and a stray `rm run.lock` (what people do
with a lock they think stale) removes nothing that guards the run. `<run dir>/run.lock` is only the note of who
holds or held it: the holder's host and pid, which is what a refused second copy names. When the run ends in an
orderly way (done, a checkpointed stop, an error it could report), its holder adds the time and the exit code,
so `python -m spmd_rl.runs` can tell a run that is running (the lock is held), stopped, failed or killed (the lock
is free and the note holds no exit code: kill -9, a lost node, a run from before exit codes were recorded).

The note is replaced whole (write_atomic: a new file renamed over it), never written through whatever stands at
that name, and a run.lock that is not a regular file (a symlink, a FIFO, a directory) is refused: writing through
a symlink would destroy its target, and opening a FIFO would wait for a writer. Readers open it without following
a symlink or waiting on a FIFO.

A second copy of the same command (another terminal, a job submitted twice) is refused with one line rather than
given the next directory: the rerun-resumes rule (run/resume.py command_run_dir) needs one run per command at a
time, and a copy that went elsewhere would leave the user two half-runs of one command."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import stat
import time
from pathlib import Path

from spmd_rl.persist.fileio import file_error, write_atomic
from spmd_rl.persist.run_files import LOCK_FILE
from spmd_rl.runtime.errors import UserError

NOTE_BYTES = 4096  # more than a note ever holds: what a reader takes of run.lock

# run directory -> (the descriptor of the directory whose flock this process holds, the note it wrote in run.lock)
_held: dict[Path, tuple[int, dict]] = {}


def lock_run_dir(run_dir: Path) -> None:
    """Take run_dir's lock for this process (until release_run_dirs), or raise a UserError naming its holder."""
    run_dir = Path(run_dir)
    key = run_dir.resolve()
    if key in _held:
        return
    try:
        fd = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise file_error(run_dir, exc, "cannot open the run directory to lock it") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UserError(
                f"run directory {run_dir} is in use by another run ({_holder(run_dir)}); wait for it to end or stop "
                f"it, or give this one another run.dir (run.resume=never starts a new directory for the same command)"
            ) from None
        except OSError as exc:  # a file system without locks: say so rather than run unguarded without a word
            raise file_error(run_dir, exc, "cannot lock the run directory") from None
        _refuse_odd_note(run_dir / LOCK_FILE)
        note = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}
        write_atomic(run_dir / LOCK_FILE, json.dumps(note) + "\n")
    except BaseException:
        os.close(fd)  # drops the flock: a refused or failed start holds nothing
        raise
    _held[key] = fd, note


def record_exit(exit_code: int) -> None:
    """Write how this run ends (exit_code) beside the holder in the run.lock of every run directory this process
    holds, keeping the lock: called before the slow part of the exit (the process groups' teardown), so that a
    launcher's SIGKILL there (plain mpirun kills ranks a second after their SIGTERM) leaves the code written."""
    for run_dir, (_, note) in _held.items():
        with contextlib.suppress(OSError, UserError):  # a record to read back, never a reason to fail an exit
            write_atomic(run_dir / LOCK_FILE, json.dumps({**note, "ended": time.time(), "exit_code": exit_code}) + "\n")


def release_run_dirs(exit_code: int | None = None) -> None:
    """Let go of every run directory this process locked (the end of a run; process exit does the same), first
    recording how it ended (exit_code; None: record nothing more) beside the holder."""
    if exit_code is not None:
        record_exit(exit_code)
    while _held:
        _, (fd, _) = _held.popitem()
        os.close(fd)  # closing the last descriptor of the open directory drops its flock


def read_lock(run_dir: Path) -> tuple[bool, dict]:
    """(held, record): whether a process holds run_dir's lock now, and what run.lock says (host, pid, since, and
    once it ended: ended, exit_code); ({} when absent, unreadable or not a regular file). A shared lock taken for a
    moment tells whether an exclusive one is held, without writing anything."""
    try:
        fd = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return False, {}
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        held = False
    except BlockingIOError:
        held = True
    except OSError:  # a file system without locks: nothing to tell
        held = False
    finally:
        os.close(fd)  # drops the shared lock too
    return held, _read_note(Path(run_dir) / LOCK_FILE)


def _refuse_odd_note(path: Path) -> None:
    """A UserError when something other than a regular file stands at run.lock's name."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    except OSError as exc:
        raise file_error(path, exc, "cannot read the run directory's lock note") from None
    if not stat.S_ISREG(mode):
        what = (
            "a symlink" if stat.S_ISLNK(mode) else "a directory" if stat.S_ISDIR(mode) else "a FIFO, socket or device"
        )
        raise UserError(
            f"{path} is not a regular file ({what}); the run writes the note of who runs here under that name: "
            f"remove it (rm {path}), or give this run another run.dir"
        )


def _read_note(path: Path) -> dict:
    """run.lock's note, or {} when absent, damaged or not a regular file; read without following a symlink or
    waiting on a FIFO, and at most NOTE_BYTES of it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return {}
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return {}
        note = json.loads(os.pread(fd, NOTE_BYTES, 0).decode())
    except (OSError, ValueError):
        return {}
    finally:
        os.close(fd)
    return note if isinstance(note, dict) else {}


def _holder(run_dir: Path) -> str:
    """'host H, pid P' from run.lock's note, as its holder wrote it."""
    note = _read_note(run_dir / LOCK_FILE)
    if "host" in note and "pid" in note:
        return f"host {note['host']}, pid {note['pid']}"
    return "host and pid unknown: its run.lock note is not written yet or was removed"
