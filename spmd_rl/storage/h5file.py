"""Opening HDF5 files, also while a writer appends (SWMR), and what is wrong with a file as a UserError naming it:
missing, truncated, damaged, left open by a writer that died, or an OS error on writing."""

from __future__ import annotations

import ctypes
import os
import time
from pathlib import Path

import h5py
import numpy as np

from spmd_rl.persist.fileio import file_error
from spmd_rl.runtime.errors import UserError

# A SWMR reader retries a metadata read whose checksum fails (the writer may be rewriting it), sleeping 1 ns, 2 ns,
# 4 ns, ... in between; HDF5's default of 100 tries makes a corrupt file hang a reader for hours. 28 tries wait
# ~0.3 s in all: ample for a live writer to finish a metadata write, short for a file that is really corrupt.
SWMR_READ_ATTEMPTS = 28


def open_h5(path: Path, mode: str, **kwargs) -> h5py.File:
    """h5py.File, with a missing, corrupt or foreign file, or one that cannot be created, as a UserError naming it."""
    try:
        return h5py.File(path, mode, **kwargs)
    except FileNotFoundError as exc:
        raise UserError(f"{path}: no such file") from exc
    except OSError as exc:
        if mode == "w":
            raise write_error(path, exc, "cannot create the file") from None
        raise UserError(f"{path} is not a readable HDF5 file: {first_line(exc)}") from exc


def open_swmr_reader(path: Path) -> h5py.File:
    """Open for reading while a writer may append (SWMR), failing within about a second on a damaged file.

    A SWMR reader skips HDF5's end-of-file check (the file may grow) and retries failed metadata reads: on a
    truncated or corrupt file it would retry for hours. So the superblock's end of file is checked against the
    file's size first, and the retries are capped (SWMR_READ_ATTEMPTS).
    """
    check_not_truncated(path)
    fapl = h5py.h5p.create(h5py.h5p.FILE_ACCESS)
    fapl.set_libver_bounds(h5py.h5f.LIBVER_EARLIEST, h5py.h5f.LIBVER_LATEST)
    set_attempts = _loaded_libhdf5().H5Pset_metadata_read_attempts
    set_attempts.argtypes = [ctypes.c_int64, ctypes.c_uint]
    set_attempts.restype = ctypes.c_int
    if set_attempts(fapl.id, SWMR_READ_ATTEMPTS) < 0:
        raise UserError(f"{path}: cannot limit HDF5's metadata read retries; read the file when no writer runs")
    try:
        return h5py.File(h5py.h5f.open(os.fsencode(path), h5py.h5f.ACC_RDONLY | h5py.h5f.ACC_SWMR_READ, fapl=fapl))
    except FileNotFoundError as exc:
        raise UserError(f"{path}: no such file") from exc
    except OSError as exc:
        raise UserError(f"{path} is not a readable HDF5 file: {first_line(exc)}") from exc


HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"


def check_not_truncated(path: Path) -> None:
    """A UserError if the file is shorter than the end of file its superblock records (a cut copy, a full disk).

    A writer extends the file right after it records a new end (one flush), so a short file is re-checked a few
    times over ~0.3 s before it is called truncated.
    """
    for pause in (0.0, 0.1, 0.2):
        time.sleep(pause)
        size, needed = _size_and_recorded_end(path)
        if needed is None or size >= needed:
            return
    raise UserError(
        f"{path} is truncated: {size} bytes, its HDF5 superblock says {needed}; the file was cut short "
        f"(an incomplete copy, or a full disk): restore it or remove it"
    )


def _size_and_recorded_end(path: Path) -> tuple[int, int | None]:
    """The file's size and base address + end-of-file address from its superblock (None: no HDF5 superblock found,
    left for HDF5 to report)."""
    try:
        with open(path, "rb") as file:
            size = os.fstat(file.fileno()).st_size
            offset = 0
            while offset + 64 <= size:  # the superblock is at 0, 512, 1024, 2048, ... (after a user block)
                file.seek(offset)
                head = file.read(64)
                if head.startswith(HDF5_SIGNATURE):
                    return size, _recorded_end(head)
                offset = 512 if offset == 0 else offset * 2
    except FileNotFoundError:
        raise UserError(f"{path}: no such file") from None
    except OSError as exc:
        raise file_error(path, exc, "cannot read") from None
    return size, None


def _recorded_end(head: bytes) -> int | None:
    version = head[8]
    if version in (0, 1):
        width = head[13]
        base_at = 24 if version == 0 else 28  # version 1 adds the indexed storage K and two reserved bytes
        base_end = (base_at, base_at + 2 * width)  # base address, then (after the free-space address) end of file
    elif version in (2, 3):
        width = head[9]
        base_end = (12, 12 + 2 * width)  # base address, extension address, end of file
    else:
        return None
    if width not in (2, 4, 8):
        return None
    base, end = (int.from_bytes(head[at : at + width], "little") for at in base_end)
    undefined = (1 << (8 * width)) - 1
    return None if undefined in (base, end) else base + end


def write_error(path: Path, exc: Exception, doing: str) -> UserError:
    """HDF5's errors carry the system's errno in their text ("errno = 28"): name the cause and what to do."""
    number = getattr(exc, "errno", None)
    if number is None:
        for known in (28, 27, 30, 13, 1, 122):  # ENOSPC, EFBIG, EROFS, EACCES, EPERM, EDQUOT
            if f"errno = {known}," in str(exc):
                number = known
    if number is not None:
        return file_error(path, OSError(number, os.strerror(number)), doing)
    return UserError(f"{path}: {doing}: {first_line(exc)}")


def first_line(exc: BaseException) -> str:
    text = str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)  # KeyError's str() quotes
    return text.splitlines()[0] if text else type(exc).__name__


DAMAGED_FILE_ERRORS = (KeyError, ValueError, OSError, RuntimeError)  # what h5py raises for damaged objects


def damaged(path: Path, exc: BaseException) -> UserError:
    """The UserError for a file HDF5 opened but cannot read (corrupt metadata, a missing object)."""
    return UserError(f"{path} is damaged: {first_line(exc)}; restore it or remove it")


def check_chunks(path: Path, dataset: h5py.Dataset, start: int, stop: int) -> None:
    """Verify the chunks holding positions [start, stop) of a dataset: a DamagedRows naming the file, the dataset
    and the rows of the first chunk that fails.

    spmd_rl writes every dataset with HDF5's fletcher32 filter: each chunk carries a checksum that HDF5 checks
    whenever it reads the chunk through its filter pipeline. So this just reads the chunks into one reused buffer
    (~0.5 GB/s here), one chunk per read: after a failed read of several chunks, HDF5 2.0's chunk cache can get
    inconsistent ("can't insert duplicate key") and later serve a damaged chunk as sound. A failed chunk is read
    once more before it is called damaged: a SWMR reader can catch a chunk half rewritten by its live writer. A
    dataset without the filter (a file written before spmd_rl checked rows) has nothing to check and is skipped."""
    if not dataset.fletcher32 or stop <= start:
        return
    chunk_rows = dataset.chunks[0]
    buffer = np.empty((chunk_rows, *dataset.shape[1:]), dataset.dtype)
    for chunk in range(start - start % chunk_rows, stop, chunk_rows):
        end = min(stop, chunk + chunk_rows)
        for attempt in range(2):
            try:
                dataset.read_direct(buffer, np.s_[chunk:end], np.s_[: end - chunk])
                break
            except DAMAGED_FILE_ERRORS as exc:
                if attempt:
                    problem = (
                        f"{path} is damaged: rows {chunk}..{end - 1} of {dataset.name} fail HDF5's checks "
                        f"({first_line(exc)})"
                    )
                    raise DamagedRows(f"{problem}; restore the file from a copy", chunk, problem) from None
                time.sleep(0.05)


class DamagedRows(UserError):
    """Rows of a dataset that fail HDF5's checks; `first` is the first of them (a position in the dataset), `problem`
    the message without its advice (a writer gives its own)."""

    def __init__(self, message: str, first: int, problem: str):
        super().__init__(message)
        self.first, self.problem = first, problem


def clear_crash_flags(path: Path) -> None:
    """Clear the 'open for writing' flags a killed SWMR writer leaves in the superblock (what `h5clear -s` does).

    HDF5 refuses to reopen such a file for writing; the file itself is consistent (that is SWMR's promise). The
    library's own switch for this is the file-access property "clear_status_flags", set through the public
    H5Pset on the libhdf5 that h5py has loaded.
    """
    lib = _loaded_libhdf5()
    fapl = h5py.h5p.create(h5py.h5p.FILE_ACCESS)
    fapl.set_libver_bounds(h5py.h5f.LIBVER_LATEST, h5py.h5f.LIBVER_LATEST)
    h5pset = lib.H5Pset
    h5pset.argtypes = [ctypes.c_int64, ctypes.c_char_p, ctypes.c_void_p]
    h5pset.restype = ctypes.c_int
    clear = ctypes.c_bool(True)
    if h5pset(fapl.id, b"clear_status_flags", ctypes.byref(clear)) < 0:
        raise UserError(f"{path} was left open by a writer that died; clear it with `h5clear -s {path}`")
    h5py.h5f.open(os.fsencode(path), h5py.h5f.ACC_RDWR, fapl=fapl).close()


def _loaded_libhdf5() -> ctypes.CDLL:
    # The exact library h5py uses (a wheel bundles its own): find it among this process's mapped files.
    with open("/proc/self/maps") as maps:
        for line in maps:
            name = os.path.basename(line.split()[-1])
            if name.startswith("libhdf5") and not name.startswith("libhdf5_hl"):
                return ctypes.CDLL(line.split()[-1])
    raise UserError("cannot find the libhdf5 loaded by h5py to clear a crashed file's flags; use `h5clear -s`")
