"""Files the program writes, written so that a crash or a full disk never leaves a torn line or half a file.

- append_line: one whole line per os.write on an O_APPEND descriptor; a short or failed write is cut back off, so
  a reader may miss the last record but never reads half of one.
- write_atomic / torch_save_atomic: the new content goes to a temporary file in the same directory, is fsynced,
  then renamed over the old one (and the directory fsynced): the path holds the old file or the new one, whole.
- make_dirs, file_error: every OSError on a path (disk full, read-only, a file where a directory should be) becomes
  a UserError naming the path and what to do.
- open_regular / bounded_lines: reading what a damaged or planted run directory may hold: a FIFO (whose open waits
  for a writer), a device such as /dev/zero (which never ends), a line without end; refused or cut off, never a hang.
- register_open_file / flush_open_files: writers that stage data in memory (the HDF5 writers) register here, and
  every exit path flushes them all.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import stat
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO, Protocol, cast

from spmd_rl.runtime.errors import UserError

_WHAT_TO_DO: dict[int | None, str] = {  # by OSError.errno (None for an error without one)
    errno.ENOSPC: "disk full; free space on that file system or choose another run.dir",
    errno.EDQUOT: "disk quota exceeded; free space or choose another run.dir",
    errno.EFBIG: "file size limit reached (ulimit -f); raise the limit or choose another run.dir",
    errno.EROFS: "read-only file system; choose a writable run.dir",
    errno.EACCES: "permission denied; choose a writable run.dir or fix its permissions",
    errno.EPERM: "permission denied; choose a writable run.dir or fix its permissions",
    errno.ENOTDIR: "a file stands where a directory is needed; remove it or choose another run.dir",
    errno.EEXIST: "a file stands where a directory is needed; remove it or choose another run.dir",
    errno.EISDIR: "a directory stands where a file is needed; remove it or choose another run.dir",
}


def file_error(path: str | os.PathLike, exc: OSError, doing: str = "cannot write") -> UserError:
    """The one-line UserError for an OSError on path: what happened and what to do."""
    what = _WHAT_TO_DO.get(exc.errno, exc.strerror or str(exc) or type(exc).__name__)
    return UserError(f"{path}: {doing}: {what}")


def make_dirs(path: str | os.PathLike) -> Path:
    """mkdir -p, with a read-only parent or a file in the way as a UserError naming the path."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # FileExistsError (EEXIST) when a file has the name of a directory on the path
        raise file_error(path, exc, "cannot create the directory") from None
    return path


class LineAppender:
    """Appends whole lines to a file: each line in one os.write on an O_APPEND descriptor.

    A write that fails or stops short (disk full, file size limit) is cut back to the file's previous length and
    raised as a UserError, so the file ends with the last whole line; the lines before it are untouched.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        try:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise file_error(self.path, exc, "cannot open for appending") from None

    def append(self, line: str) -> None:
        data = line.encode() if line.endswith("\n") else (line + "\n").encode()
        before = os.fstat(self._fd).st_size
        try:
            written = os.write(self._fd, data)
            if written != len(data):  # the disk filled up (or a size limit was hit) mid-line
                os.write(self._fd, data[written:])  # raises the reason; if space came back, the line is whole
        except OSError as exc:
            self._cut_back(before)
            raise file_error(self.path, exc) from None

    def _cut_back(self, length: int) -> None:
        try:
            os.ftruncate(self._fd, length)
        except OSError:
            pass  # nothing more can be done; the UserError about the write is what the user needs

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


@contextlib.contextmanager
def _replacing(path: Path) -> Iterator[BinaryIO]:
    """A binary file object whose content replaces path, whole, when the block ends without an error."""
    temporary = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(temporary, "wb") as file:
            yield file
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
        _fsync_directory(path.parent)
    except OSError as exc:
        _remove_quietly(temporary)
        raise file_error(path, exc) from None
    except BaseException:
        _remove_quietly(temporary)
        raise


def _fsync_directory(directory: Path) -> None:
    # The rename is durable only once the directory entry is on disk.
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_quietly(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink()


def file_kind(mode: int) -> str:
    """What a file of this st_mode is, for a line: 'a regular file', 'a FIFO', ..."""
    kinds = [(stat.S_ISREG, "a regular file"), (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO")]
    kinds.append((stat.S_ISCHR, "a character device"))
    return next((name for test, name in kinds if test(mode)), "a block device or socket")


class NotRegularFile(OSError):
    """What open_regular raises for a path that is no regular file: its message names the path and what it is."""


def open_regular(path: str | os.PathLike) -> BinaryIO:
    """path opened for reading when it is a regular file (symlinks followed), else a NotRegularFile. Opened without
    waiting (a FIFO's open waits for a writer) and checked on the descriptor, so nothing reads a FIFO or a device."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotRegularFile(f"{path} is not a regular file ({file_kind(mode)})")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "rb")


def bounded_lines(file: BinaryIO, max_line: int) -> Iterator[bytes | None]:
    """The lines of file from where it stands, without their newline; None for a line longer than max_line bytes,
    which is skipped a chunk at a time rather than held whole."""
    while line := file.readline(max_line + 1):
        if line.endswith(b"\n"):
            yield line[:-1]
        elif len(line) <= max_line:
            yield line  # the last line, torn or without its newline
        else:
            while (rest := file.readline(max_line)) and not rest.endswith(b"\n"):
                pass
            yield None


def write_atomic(path: str | os.PathLike, content: bytes | str) -> None:
    """Replace path with content: readers see the old file or the new one, never a part of it."""
    path = Path(path)
    with _replacing(path) as file:
        file.write(content.encode() if isinstance(content, str) else content)


# torch.save writes a zip archive whose reader ignores what follows it, and torch.load does not check the zip's
# CRCs: flipped bytes in tensor data load silently. So every file torch_save_atomic writes ends with this trailer and
# the SHA-256 of everything before it (64 hex digits, a newline); the file stays loadable by a plain torch.load.
CHECKSUM_TRAILER = b"\nspmd_rl-sha256:"
_TRAILER_BYTES = len(CHECKSUM_TRAILER) + 64 + 1


def torch_save_atomic(obj, path: str | os.PathLike) -> None:
    """torch.save(obj, path) followed by the checksum trailer, written to a temporary file first and renamed over
    path (see write_atomic)."""
    import torch  # imported here: the text helpers above are used by modules that need not load torch

    path = Path(path)
    with _replacing(path) as file:
        recording = _RecordingWriter(file)
        try:
            torch.save(obj, cast(BinaryIO, recording))  # a file object to torch.save: write() is all it calls
        except RuntimeError:  # torch's writer reports a failed write as a RuntimeError: raise the OSError behind it
            if recording.error is None:
                raise
            raise recording.error from None
        file.write(CHECKSUM_TRAILER + recording.digest.hexdigest().encode() + b"\n")


def sha256_of(path: str | os.PathLike) -> str:
    """The SHA-256 of a whole file ('' when it is missing, cannot be read or is no regular file: a FIFO would be
    waited on, a device read without end)."""
    digest = hashlib.sha256()
    try:
        with open_regular(path) as file:
            for block in iter(lambda: file.read(1 << 20), b""):
                digest.update(block)
    except OSError:
        return ""
    return digest.hexdigest()


def checksum_matches(path: str | os.PathLike) -> bool | None:
    """Whether a file torch_save_atomic wrote still holds what was written: True, False (damaged), or None when
    it has no trailer (written by torch.save itself, or by an older version), which cannot be checked."""
    with open(path, "rb") as file:
        size = file.seek(0, os.SEEK_END)
        if size < _TRAILER_BYTES:
            return None
        file.seek(size - _TRAILER_BYTES)
        trailer = file.read()
        if not trailer.startswith(CHECKSUM_TRAILER):
            return None
        expected = trailer[len(CHECKSUM_TRAILER) : -1].decode("ascii", "replace")
        digest = hashlib.sha256()
        file.seek(0)
        remaining = size - _TRAILER_BYTES
        while remaining:
            block = file.read(min(remaining, 1 << 22))
            if not block:
                return False
            digest.update(block)
            remaining -= len(block)
    return digest.hexdigest() == expected


class _RecordingWriter:
    """A file object that keeps the OSError of a failed write (torch.save hides it in a RuntimeError) and the
    SHA-256 of what it wrote."""

    def __init__(self, file: BinaryIO):
        self.file = file
        self.error: OSError | None = None
        self.digest = hashlib.sha256()  # of everything written, for the checksum trailer

    def write(self, data) -> int:
        try:
            written = self.file.write(data)
            self.digest.update(memoryview(data).cast("B")[:written])
            return written
        except OSError as exc:
            self.error = exc
            raise

    def flush(self) -> None:
        self.file.flush()


class Flushable(Protocol):
    def flush(self) -> None: ...


_OPEN_FILES: dict[Path, Flushable] = {}  # resolved path -> its open writer in this process


def load_failure(exc: Exception) -> str:
    """Why torch.load(..., weights_only=True) refused a file, in one line. A refusal of pickled objects says so in
    our words: torch's own message advises loading with weights_only=False, which would run the file's code."""
    text = str(exc).strip()
    if "Weights only load failed" in text:
        unsupported = next((part for part in text.split("\n") if "Unsupported global" in part), "")
        found = unsupported.split(":", 2)[-1].split(" was not")[0].strip() if unsupported else ""
        named = f" ({found})" if found else ""
        return (
            f"it holds pickled Python objects{named} besides tensors and plain values, which spmd_rl never loads "
            f"(loading them could run the file's code); it was not written by spmd_rl or was altered"
        )
    return text.splitlines()[0] if text else type(exc).__name__


def register_open_file(path: Path, writer: Flushable) -> None:
    """Claim path for writer (one writer per file: HDF5 would silently share a second handle) and have
    flush_open_files flush it until unregister_open_file."""
    key = path.resolve()
    if key in _OPEN_FILES:
        raise UserError(f"{path} is already open for writing in this process; one writer per file")
    _OPEN_FILES[key] = writer


def unregister_open_file(path: Path) -> None:
    _OPEN_FILES.pop(path.resolve(), None)


def flush_open_files() -> None:
    """Write what every registered writer holds in memory: for every exit path (a finally-block in main).

    Safe to call twice. A writer that cannot flush (disk full, a signal meanwhile) is reported in one line on stderr
    and the others are still flushed; nothing is raised, so the error that ended the run stays the one reported.
    """
    for path, writer in list(_OPEN_FILES.items()):
        try:
            writer.flush()
        except BaseException as exc:  # noqa: BLE001 - on the way out: report, never mask the original error
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            print(
                f"spmd_rl: error: {first if isinstance(exc, UserError) else f'{path}: could not flush: {first}'}",
                file=sys.stderr,
                flush=True,
            )
