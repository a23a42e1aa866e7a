"""One writer per run directory: rank 0 holds two flocks from the moment it chose the directory until its process
ends the run, one on the run directory itself and one on `<run dir>/run.lock`, and a second copy is refused while
either is held. The directory's cannot be removed by a stray `rm run.lock` (what people do with a lock they think
stale); the file's is the one a network file system shares between hosts (NFS makes a file's flock a lock on the
server, a directory's stays on its own host). The kernel drops an flock when its holder dies (kill -9, a node's
crash as the file system sees it), so nothing stale is ever left to clean up.

run.lock also holds the note of who holds or held the lock: the holder's host and pid, which is what a refused
second copy names. When the run ends in an orderly way (done, a checkpointed stop, an error it could report), its
holder adds the time and the exit code, so `python -m spmd_rl.runs` can tell a run that is running (a lock is
held), stopped, failed or killed (the locks are free and the note holds no exit code: kill -9, a lost node, a run
from before exit codes were recorded). A start that changed nothing of the run (refused, or failed before its first
checkpoint: `own_run_dirs` not called) puts back the note it found instead, byte for byte, and removes the run.lock
it created where there was none: a refused resume of a stopped run leaves it stopped, not failed. A run.lock
removed while the run held it (`rm run.lock`) is written anew at its name when the run ends, so the run reads
stopped or failed rather than unknown. The note is written into the file the holder opened itself, never through
a symlink (O_NOFOLLOW), and a run.lock that is not a regular file of one link (a symlink, a FIFO, a directory, a
hard link to another file) is refused: writing through it would destroy what it points at, and opening a FIFO
would wait for a writer. Readers open it without following a symlink or waiting on a FIFO.

`rm -rf` of the whole run directory while its run goes on (and a new directory made at its name) leaves both flocks
with the removed directory's files: a third lock is on the path itself, a Unix socket in Linux's abstract namespace
named after the resolved path, which no `rm` can remove (it is no file) and the kernel frees when its holder dies;
a start that takes the flocks of a new directory but not that name is refused, naming the holder's pid (fault pass
8, "rm -rf of a running run's directory": a second copy wrote beside the first). One host only, like any socket:
across hosts of an NFS share the flocks stand alone.

A second copy of the same command (another terminal, a job submitted twice) is refused with one line rather than
given the next directory: the rerun-resumes rule (run/resume.py command_run_dir) needs one run per command at a
time, and a copy that went elsewhere would leave the user two half-runs of one command."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import socket
import stat
import sys
import time
from pathlib import Path

from spmd_rl.persist.fileio import file_error
from spmd_rl.persist.run_files import LOCK_FILE
from spmd_rl.runtime.errors import UserError

NOTE_BYTES = 4096  # more than a note ever holds: what a reader takes of run.lock

# run directory -> (the directory's descriptor, or None where its file system refused the flock, and run.lock's:
# the descriptors whose flocks this process holds)
_held: dict[Path, tuple[int | None, int]] = {}
# run directory -> the socket bound to its path's name (_claim_path), where the platform has such names
_claimed: dict[Path, socket.socket] = {}
# run directory -> the run.lock note found there when this process locked it, until this start owns the run (its
# first checkpoint): what its exit puts back (None: there was no run.lock, so the exit removes the one it made)
_found: dict[Path, bytes | None] = {}


def lock_run_dir(run_dir: Path, named: bool = False) -> None:
    """Take run_dir's locks for this process (until release_run_dirs), or raise a UserError naming its holder.
    named: the config named run.dir (its refusal then does not suggest run.resume=never, which only picks a new
    directory for a command's own)."""
    run_dir = Path(run_dir)
    key = run_dir.resolve()
    if key in _held:
        return
    dir_fd = note_fd = None
    claim = None
    try:
        dir_fd = _open_dir(run_dir)
        if not _lock(dir_fd, run_dir, named):
            os.close(dir_fd)  # a file system that locks no directory: run.lock's flock alone guards the run
            dir_fd = None
        claim = _claim_path(key, run_dir)  # after the directory's flock, which names a plain second copy's holder
        _refuse_odd_note(run_dir / LOCK_FILE)
        existed = os.path.lexists(run_dir / LOCK_FILE)
        note_fd = _open_note(run_dir / LOCK_FILE)
        if not _lock(note_fd, run_dir, named) and dir_fd is None:  # say so rather than run unguarded without a word
            raise UserError(f"{run_dir}: cannot lock the run directory: its file system takes no flock")
        found = os.pread(note_fd, NOTE_BYTES + 1, 0)
        note = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}) + "\n"
        os.ftruncate(note_fd, 0)
        os.pwrite(note_fd, note.encode(), 0)
    except BaseException as exc:
        for fd in (dir_fd, note_fd):  # drops the flocks: a refused or failed start holds nothing
            if fd is not None:
                os.close(fd)
        if claim is not None:
            claim.close()
        if isinstance(exc, OSError):
            raise file_error(run_dir / LOCK_FILE, exc, "cannot write the run directory's lock") from None
        raise
    _held[key] = dir_fd, note_fd
    if claim is not None:
        _claimed[key] = claim
    if not existed:
        _found[key] = None
    elif len(found) <= NOTE_BYTES:  # a note of an earlier start, or an empty file (a longer one is no note of ours)
        _found[key] = found


def own_run_dirs() -> None:
    """This start changed its run directory (its first checkpoint is committed): its exit is recorded in run.lock
    from now on, in place of the note an earlier start left there."""
    _found.clear()


def record_exit(exit_code: int) -> None:
    """Write how this run ends (exit_code) beside the holder in every run.lock this process holds, keeping the
    lock: called before the slow part of the exit (the process groups' teardown), so that a launcher's SIGKILL
    there (plain mpirun kills ranks a second after their SIGTERM) leaves the code written. A start that did not
    come to own its directory (own_run_dirs) puts back the note it found there, or removes the run.lock it made."""
    for key, (_, fd) in _held.items():
        with contextlib.suppress(OSError, ValueError):  # a record to read back, never a reason to fail an exit
            if key in _found:
                found = _found[key]
                if found is None:
                    _remove_own_note(key / LOCK_FILE, fd)
                    continue
                record = found
            else:
                holder = json.loads(os.pread(fd, NOTE_BYTES, 0).decode())
                record = (json.dumps({**holder, "ended": time.time(), "exit_code": exit_code}) + "\n").encode()
                _rewrite_removed_note(key / LOCK_FILE, fd, record)
            os.ftruncate(fd, 0)
            os.pwrite(fd, record, 0)


def _is_own_note(path: Path, fd: int) -> bool:
    """Whether path still names the file this process opened as fd (not removed, not replaced)."""
    try:
        here, own = os.lstat(path), os.fstat(fd)
    except FileNotFoundError:
        return False
    return (here.st_dev, here.st_ino) == (own.st_dev, own.st_ino)


def _remove_own_note(path: Path, fd: int) -> None:
    """A refused start found no run.lock: the one it made goes (only if it is still the file it made)."""
    if _is_own_note(path, fd):
        os.unlink(path)


def _rewrite_removed_note(path: Path, fd: int, record: bytes) -> None:
    """run.lock was removed while this run held it: the exit code goes into a new file at its name, since the
    removed one is read by nobody. Never through whatever else stands there now (O_EXCL, O_NOFOLLOW)."""
    if _is_own_note(path, fd) or os.path.lexists(path):
        return
    new_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        os.write(new_fd, record)
    finally:
        os.close(new_fd)


def release_run_dirs(exit_code: int | None = None) -> None:
    """Let go of every run directory this process locked (the end of a run; process exit does the same), first
    recording how it ended (exit_code; None: record nothing more) beside the holder."""
    if exit_code is not None:
        record_exit(exit_code)
    _found.clear()
    while _claimed:
        _claimed.popitem()[1].close()
    while _held:
        _, fds = _held.popitem()
        for fd in fds:
            if fd is not None:
                os.close(fd)  # closing the last descriptor of an open file drops its flock


def read_lock(run_dir: Path) -> tuple[bool, dict]:
    """(held, record): whether a process holds run_dir's lock now, and what run.lock says (host, pid, since, and
    once it ended: ended, exit_code); ({} when absent, unreadable or not a regular file)."""
    run_dir = Path(run_dir)
    held = _held_elsewhere(run_dir, os.O_RDONLY | os.O_DIRECTORY) or _held_elsewhere(
        run_dir / LOCK_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK
    )
    return held, _read_note(run_dir / LOCK_FILE)


def _held_elsewhere(path: Path, flags: int) -> bool:
    """Whether a process holds an exclusive flock on path: a shared one, taken for a moment, says so without
    writing anything."""
    try:
        fd = os.open(path, flags | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    except OSError:  # a file system without locks: nothing to tell
        return False
    finally:
        os.close(fd)  # drops the shared lock too


def _open_dir(run_dir: Path) -> int:
    try:
        return os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise file_error(run_dir, exc, "cannot open the run directory to lock it") from None


def _open_note(path: Path) -> int:
    """run.lock opened for writing without following a symlink or waiting on a FIFO; a UserError unless it is a
    regular file of one link (a hard link's other name would be truncated with it)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    info = os.fstat(fd)
    if stat.S_ISREG(info.st_mode) and info.st_nlink == 1:
        return fd
    os.close(fd)
    _refuse_odd_note(path)  # it changed under us: say what it is now
    raise UserError(
        f"{path} has {info.st_nlink} hard links; the run writes the note of who runs here into it: remove it "
        f"(rm {path}), or give this run another run.dir"
    )


def _lock(fd: int, run_dir: Path, named: bool) -> bool:
    """An exclusive flock on fd: True when taken, False when the file system takes none; a UserError naming the
    holder when another process holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        never = "" if named else " (run.resume=never starts a new directory for the same command)"
        raise UserError(
            f"run directory {run_dir} is in use by another run ({_holder(run_dir)}); wait for it to end or stop it, "
            f"or give this one another run.dir{never}"
        ) from None
    except OSError:
        return False


def _claim_path(key: Path, run_dir: Path) -> socket.socket | None:
    """The lock on the run directory's path (see the module's docstring): a listening socket bound to a name
    derived from key, or None where there are no abstract socket names (not Linux); a UserError naming the holder
    when another process has that name, which it keeps although the directory it locked was removed."""
    if not sys.platform.startswith("linux"):
        return None
    name = b"\0spmd_rl/run-dir/" + hashlib.sha256(os.fsencode(key)).hexdigest().encode()
    claim = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        claim.bind(name)
        claim.listen(8)  # a refused start asks the holder's pid by connecting (SO_PEERCRED); nobody accepts
    except OSError as exc:
        claim.close()
        if exc.errno != errno.EADDRINUSE:
            return None  # no such names here (a sandbox): the flocks alone guard the run
        raise UserError(
            f"run directory {run_dir} is in use by another run (this host, {_path_holder(name)}), whose directory "
            f"was removed while it ran and made again: stop that run first (kill -TERM <pid>), or give this one "
            f"another run.dir"
        ) from None
    return claim


def _path_holder(name: bytes) -> str:
    """'pid P' of the process holding the socket name, as the kernel says (SO_PEERCRED)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    probe.settimeout(1.0)
    try:
        probe.connect(name)
        credentials = probe.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
        return f"pid {int.from_bytes(credentials[:4], sys.byteorder)}"
    except OSError:
        return "pid unknown"
    finally:
        probe.close()


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
    return _read_note_and_damage(path)[0]


def note_damage(run_dir: Path) -> str:
    """Why run_dir's run.lock holds no readable note ('' when it reads, is absent or is empty: a holder killed
    between creating it and writing its note), for `python -m spmd_rl.runs` to say."""
    return _read_note_and_damage(Path(run_dir) / LOCK_FILE)[1]


def _read_note_and_damage(path: Path) -> tuple[dict, str]:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return {}, ""
    except OSError as exc:
        what = "is a symlink" if exc.errno == errno.ELOOP else f"cannot be read ({exc.strerror})"
        return {}, f"{path} {what}: its exit code is not read"
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return {}, f"{path} is not a regular file: its exit code is not read"
        data = os.pread(fd, NOTE_BYTES, 0)
        if not data:
            return {}, ""
        note = json.loads(data.decode())
    except (OSError, ValueError):
        return {}, f"{path} holds no whole note (torn or overwritten): how the run ended is not known"
    finally:
        os.close(fd)
    if not isinstance(note, dict):
        return {}, f"{path} holds no whole note (torn or overwritten): how the run ended is not known"
    return note, ""


def _holder(run_dir: Path) -> str:
    """'host H, pid P' from run.lock's note, as its holder wrote it."""
    note = _read_note(run_dir / LOCK_FILE)
    if "host" in note and "pid" in note:
        return f"host {note['host']}, pid {note['pid']}"
    return "host and pid unknown: its run.lock note is not written yet or was removed"
