"""Experience on disk: one HDF5 file per writing rank, readable with plain h5py while it is being written.

File layout (format "spmd_rl.hdf5", version 1):

    /data/<key>            one chunked dataset per TensorDict leaf, shape (rows, *leaf_shape); nested keys are
                           groups (("next", "obs") -> /data/next/obs)
    /meta/policy_version   int64 per row: the policy version that acted (-1 = not recorded)
    /meta/env_id           int64 per row: the env's index on the writing rank (-1 = not recorded)
    /meta/env_step         int64 per row: the rank's env-step counter for the row (-1 = not recorded)
    /cursor                int64[2]: [committed, reserved] row counts over the file's life (see below)
    attributes of /        format, format_version, schema (JSON: key -> shape, numpy dtype string), capacity
                           (0 = grows without bound, else a ring of that many rows), chunk_rows, compression,
                           writer_pid, writer_host (the last process that opened it for writing)

Row r (counting from the file's first row) is stored at position r, or r % capacity in ring mode. The valid rows
are r in [max(0, reserved - capacity), committed) in ring mode, [0, committed) otherwise (reserved == committed
there). Rows are written first and `committed` raised after them; before a ring write overwrites old rows,
`reserved` is raised past it, which takes the rows about to be overwritten out of the valid range. Each step is
followed by a file flush, so a reader, or the file after kill -9, never sees a row that is not whole; a crash in
the middle of a ring write just leaves fewer valid rows, until later writes pass `reserved`. The cursor lives in a
dataset rather than in attributes because the file is kept in SWMR mode (single writer, many readers): readers
refresh datasets to see new rows.

Appends are staged in memory and written as whole chunks, up to ~4 MiB at a time (tiny HDF5 writes are ~10x slower
per byte), or sooner: when the oldest staged row has waited `flush_every_s` seconds, the append that notices it
writes what is staged (checked on every append). After kill -9 the file opens and holds every row up to the last
write: what is missing was appended in the last flush_every_s seconds (plus the time since the last append). Every
orderly exit path calls fileio.flush_open_files(), which writes what every open writer has staged.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import math
import os
import socket
import time
from collections.abc import Mapping
from pathlib import Path

import h5py
import numpy as np
import torch
from tensordict import TensorDict

from spmd_rl.runtime.errors import UserError
from spmd_rl.persist.fileio import file_error, make_dirs, register_open_file, unregister_open_file
from spmd_rl.runtime.distributed import signals_deferred

FORMAT_NAME = "spmd_rl.hdf5"
FORMAT_VERSION = 1
DATA_GROUP = "data"
META_GROUP = "meta"
CURSOR = "cursor"
META_FIELDS = ("policy_version", "env_id", "env_step")
COMPRESSIONS = (None, "lzf")  # fast codecs only: gzip writes at 30-70 MB/s, far below the hot path
STAGE_BYTES = 4 << 20  # small appends are staged in memory up to this many bytes (whole chunks) per write
DEFAULT_FLUSH_EVERY_S = 2.0  # staged rows wait at most this long before an append writes them (config default)
# A SWMR reader retries a metadata read whose checksum fails (the writer may be rewriting it), sleeping 1 ns, 2 ns,
# 4 ns, ... in between; HDF5's default of 100 tries makes a corrupt file hang a reader for hours. 28 tries wait
# ~0.3 s in all: ample for a live writer to finish a metadata write, short for a file that is really corrupt.
SWMR_READ_ATTEMPTS = 28

# A field of the layout: the shape of one row and its numpy dtype.
Field = tuple[tuple[int, ...], np.dtype]

_TORCH_TO_NUMPY = {
    torch.float16: np.float16, torch.float32: np.float32, torch.float64: np.float64,
    torch.int8: np.int8, torch.int16: np.int16, torch.int32: np.int32, torch.int64: np.int64,
    torch.uint8: np.uint8, torch.bool: np.bool_,
}


def layout_of(spec: Mapping | TensorDict) -> dict[str, Field]:
    """Normalize a layout: {key: (shape, dtype)} or an example TensorDict (its batch dims are the row dims).

    Keys become "/"-joined paths ("next/obs" for ("next", "obs")); dtypes become numpy dtypes.
    """
    if isinstance(spec, TensorDict):
        rows_dims = spec.batch_dims
        return {_path(key): (tuple(value.shape[rows_dims:]), _numpy_dtype(value.dtype, key))
                for key, value in spec.items(include_nested=True, leaves_only=True)}
    layout = {}
    for key, (shape, dtype) in spec.items():
        dtype = _numpy_dtype(dtype, key) if isinstance(dtype, torch.dtype) else np.dtype(dtype)
        layout[_path(key)] = (tuple(int(n) for n in shape), dtype)
    return layout


def _path(key) -> str:
    return "/".join(key) if isinstance(key, tuple) else str(key)


def _numpy_dtype(dtype: torch.dtype, key) -> np.dtype:
    if dtype not in _TORCH_TO_NUMPY:
        raise UserError(f"key {_path(key)!r} has dtype {dtype}, which HDF5 storage does not support; "
                        f"supported: {', '.join(str(d) for d in _TORCH_TO_NUMPY)}")
    return np.dtype(_TORCH_TO_NUMPY[dtype])


def default_chunk_rows(layout: dict[str, Field]) -> int:
    """About 1 MiB of rows per chunk (a power of two, 64..16384 rows): big enough that the per-chunk cost (resize,
    write, two flushes, ~1 ms here) stays small against the bytes written, small enough to stage in memory."""
    row_bytes = sum(dtype.itemsize * int(np.prod(shape)) for shape, dtype in layout.values()) + 8 * len(META_FIELDS)
    rows = 1 << max(0, (2**20 // row_bytes).bit_length() - 1)
    return max(64, min(16384, rows))


def schema_json(layout: dict[str, Field]) -> str:
    return json.dumps({key: {"shape": list(shape), "dtype": dtype.str} for key, (shape, dtype) in layout.items()},
                      sort_keys=True)


def layout_from_schema(text: str) -> dict[str, Field]:
    return {key: (tuple(field["shape"]), np.dtype(field["dtype"])) for key, field in json.loads(text).items()}


def describe_field(field: Field) -> str:
    shape, dtype = field
    return f"{dtype.name}{list(shape)}"


def schema_difference(path: Path, file_layout: dict[str, Field], wanted: dict[str, Field]) -> str | None:
    """The first difference between a file's layout and the wanted one, as a message; None if they match."""
    for key in sorted(set(file_layout) | set(wanted)):
        if key not in wanted:
            return f"{path}: key {key!r} is in the file but not in the new layout"
        if key not in file_layout:
            return f"{path}: key {key!r} of the new layout is not in the file"
        if file_layout[key] != wanted[key]:
            return (f"{path}: key {key!r} is {describe_field(file_layout[key])} in the file but "
                    f"{describe_field(wanted[key])} in the new layout")
    return None


def rows_of(td: TensorDict | Mapping, layout: dict[str, Field]) -> tuple[dict[str, np.ndarray], int]:
    """The numpy arrays of a batch of rows, keyed by path, checked against the layout; and the row count.

    This runs on every append, so it is kept to one pass over the leaves (~15 us for five keys).
    """
    if isinstance(td, TensorDict):
        td = td.reshape(-1) if td.batch_dims != 1 else td
        items = td.items(include_nested=True, leaves_only=True)
    else:
        items = td.items()
    arrays = {key if isinstance(key, str) else "/".join(key):
              value.numpy(force=True) if isinstance(value, torch.Tensor) else np.asarray(value)
              for key, value in items}
    if arrays.keys() != layout.keys():
        missing, extra = sorted(layout.keys() - arrays.keys()), sorted(arrays.keys() - layout.keys())
        raise UserError(f"rows do not match the storage layout: missing keys {missing}, unexpected keys {extra}")
    first = next(iter(arrays.values()), None)
    rows = first.shape[0] if first is not None and first.ndim else 0
    for key, (shape, dtype) in layout.items():
        array = arrays[key]
        if array.shape[1:] != shape or array.dtype != dtype or array.shape[:1] != (rows,):
            raise UserError(f"key {key!r}: rows are {array.dtype.name}{list(array.shape)} (rows first), the storage "
                            f"layout says {describe_field((shape, dtype))} per row, {rows} rows like the first key")
    return arrays, rows


def open_h5(path: Path, mode: str, **kwargs) -> h5py.File:
    """h5py.File, with a missing, corrupt or foreign file, or one that cannot be created, as a UserError naming it."""
    try:
        return h5py.File(path, mode, **kwargs)
    except FileNotFoundError as exc:
        raise UserError(f"{path}: no such file") from exc
    except OSError as exc:
        if mode == "w":
            raise _write_error(path, exc, "cannot create the file") from None
        raise UserError(f"{path} is not a readable HDF5 file: {_first_line(exc)}") from exc


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
        raise UserError(f"{path} is not a readable HDF5 file: {_first_line(exc)}") from exc


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
    raise UserError(f"{path} is truncated: {size} bytes, its HDF5 superblock says {needed}; the file was cut short "
                    f"(an incomplete copy, or a full disk): restore it or remove it")


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
    base, end = (int.from_bytes(head[at:at + width], "little") for at in base_end)
    undefined = (1 << (8 * width)) - 1
    return None if undefined in (base, end) else base + end


def _write_error(path: Path, exc: Exception, doing: str) -> UserError:
    """HDF5's errors carry the system's errno in their text ("errno = 28"): name the cause and what to do."""
    number = getattr(exc, "errno", None)
    if number is None:
        for known in (28, 27, 30, 13, 1, 122):  # ENOSPC, EFBIG, EROFS, EACCES, EPERM, EDQUOT
            if f"errno = {known}," in str(exc):
                number = known
    if number is not None:
        return file_error(path, OSError(number, os.strerror(number)), doing)
    return UserError(f"{path}: {doing}: {_first_line(exc)}")


def _first_line(exc: BaseException) -> str:
    text = str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)  # KeyError's str() quotes
    return text.splitlines()[0] if text else type(exc).__name__


DAMAGED_FILE_ERRORS = (KeyError, ValueError, OSError, RuntimeError)  # what h5py raises for damaged objects


def damaged(path: Path, exc: BaseException) -> UserError:
    """The UserError for a file HDF5 opened but cannot read (corrupt metadata, a missing object)."""
    return UserError(f"{path} is damaged: {_first_line(exc)}; restore it or remove it")


def check_format(path: Path, file: h5py.File) -> None:
    if file.attrs.get("format") != FORMAT_NAME:
        raise UserError(f"{path} is an HDF5 file but not an spmd_rl experience file (no format={FORMAT_NAME} "
                        f"attribute)")
    version = int(file.attrs.get("format_version", -1))
    if version != FORMAT_VERSION:
        raise UserError(f"{path} has format version {version}; this spmd_rl reads version {FORMAT_VERSION}")


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


def _writer_is_alive(file: h5py.File) -> int | None:
    """The pid of the process that last opened this file for writing, if it still runs on this host."""
    pid, host = int(file.attrs.get("writer_pid", -1)), file.attrs.get("writer_host", "")
    if pid <= 0 or host != socket.gethostname():
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        return pid
    return pid


def check_rewind(where, total_rows: int, appended: int, capacity: int) -> None:
    """Refuse a rewind to total_rows that would need rows a ring has overwritten since (or rows never appended)."""
    if not 0 <= total_rows <= appended:
        raise UserError(f"{where}: cannot rewind to {total_rows} rows; {appended} have been appended")
    overwritten = appended - max(total_rows, capacity) if capacity else 0
    if overwritten > 0:
        raise UserError(f"{where}: cannot rewind to {total_rows} rows: {overwritten} of the rows held then have "
                        f"been overwritten since (ring of {capacity} rows)")


class HDF5Writer:
    """Append rows of a fixed layout to one HDF5 file, in whole chunks, crash-safe and readable while written.

    Opening an existing file continues it (contents and cursor are restored) if its layout, capacity and chunking
    match; a different layout is a UserError naming the file, the key and the difference. `capacity` makes it a
    ring of that many rows (the replay buffer); None grows without bound (the experience log). chunk_rows None
    or 0 picks about 1 MiB of rows per chunk for a new file and keeps an existing file's. Staged rows are written
    once the oldest has waited flush_every_s seconds (0: every append writes; math.inf: only whole stages).
    """

    def __init__(self, path: str | os.PathLike, layout: Mapping | TensorDict, *, chunk_rows: int | None = None,
                 compression: str | None = None, capacity: int | None = None, overwrite: bool = False,
                 flush_every_s: float = DEFAULT_FLUSH_EVERY_S):
        if not flush_every_s >= 0:  # also refuses NaN
            raise UserError(f"buffer.flush_every_s must be >= 0 (0: write on every append), got {flush_every_s}")
        if compression not in COMPRESSIONS:
            raise UserError(f"HDF5 compression {compression!r} is not supported; choose one of {COMPRESSIONS} "
                            f"(gzip is too slow for appends on the training path)")
        if (chunk_rows or 0) < 0 or (capacity is not None and capacity < 1):
            raise UserError(f"HDF5 chunk_rows ({chunk_rows}) must be >= 0 (0: automatic) and capacity "
                            f"({capacity}) at least 1")
        self.path = Path(path)
        register_open_file(self.path, self)
        try:
            self._open(layout, chunk_rows, compression, capacity, overwrite, flush_every_s)
        except BaseException:
            unregister_open_file(self.path)
            raise

    def _open(self, layout, chunk_rows, compression, capacity, overwrite, flush_every_s) -> None:
        self.flush_every_s = flush_every_s
        self.layout = layout_of(layout)
        self.capacity = capacity or 0
        self._chunk_rows_asked = chunk_rows
        chunk_rows = chunk_rows or default_chunk_rows(self.layout)
        self.chunk_rows = min(chunk_rows, capacity) if capacity else chunk_rows
        self.compression = compression
        self._fields = {f"{DATA_GROUP}/{key}": field for key, field in self.layout.items()}
        self._fields.update({f"{META_GROUP}/{name}": ((), np.dtype(np.int64)) for name in META_FIELDS})
        # No chunk cache for uncompressed files: appends are whole chunks that go straight to the file anyway, and
        # sampled rows are read from the file directly (_read_committed), not through whole cached chunks.
        self._chunk_cache = {"rdcc_nbytes": 0} if compression is None else {}
        if self.path.exists() and not overwrite:
            self._file = self._open_existing()
        else:
            make_dirs(self.path.parent)
            self._file = self._create()
        self._datasets = {name: self._file[name] for name in self._fields}
        self._cursor = self._file[CURSOR]
        self._committed, self._reserved = (int(n) for n in self._cursor[:])
        self._truncate_to_cursor()
        self._file.swmr_mode = True  # from here on: no new objects or attributes, readers may attach
        self.stage_rows = self.chunk_rows * self._chunks_per_write()
        self._staging = {name: np.empty((self.stage_rows, *shape), dtype) for name, (shape, dtype)
                         in self._fields.items()}
        self._staged = 0
        self._write_due = math.inf  # monotonic time by which the staged rows are to be written
        self._direct_fd = os.open(self.path, os.O_RDONLY) if compression is None else None
        self._chunk_addresses: dict[str, dict[int, int]] = {}
        self._released = False  # closed, or given up after a failed write

    # -- opening -----------------------------------------------------------------------------------------------

    def _create(self) -> h5py.File:
        file = open_h5(self.path, "w", libver="latest", **self._chunk_cache)
        for name, (shape, dtype) in self._fields.items():
            file.create_dataset(name, shape=(0, *shape), maxshape=(self.capacity or None, *shape), dtype=dtype,
                                chunks=(self.chunk_rows, *shape), compression=self.compression)
        file.create_dataset(CURSOR, data=np.zeros(2, dtype=np.int64))
        file.attrs.update({"format": FORMAT_NAME, "format_version": FORMAT_VERSION,
                           "schema": schema_json(self.layout), "capacity": self.capacity,
                           "chunk_rows": self.chunk_rows, "compression": self.compression or "none"})
        self._mark_writer(file)
        return file

    def _open_existing(self) -> h5py.File:
        try:
            file = h5py.File(self.path, "r+", libver="latest", **self._chunk_cache)
        except OSError as exc:
            if "already open for write" not in str(exc):
                raise UserError(f"{self.path} is not a readable HDF5 file: {_first_line(exc)}") from exc
            # Left open by a writer: refuse if it still runs here, otherwise it crashed and the file is sound.
            with open_swmr_reader(self.path) as previous:
                check_format(self.path, previous)
                pid = _writer_is_alive(previous)
            if pid is not None:
                raise UserError(f"{self.path} is being written by process {pid}; one writer per file") from exc
            clear_crash_flags(self.path)
            file = open_h5(self.path, "r+", libver="latest", **self._chunk_cache)
        try:
            self._check_matches(file)
        except (UserError, *DAMAGED_FILE_ERRORS) as exc:
            file.close()
            raise exc if isinstance(exc, UserError) else damaged(self.path, exc) from None
        self._mark_writer(file)
        return file

    def _check_matches(self, file: h5py.File) -> None:
        check_format(self.path, file)
        difference = schema_difference(self.path, layout_from_schema(file.attrs["schema"]), self.layout)
        if difference:
            raise UserError(difference)
        if not self._chunk_rows_asked:  # not asked for: continue with the file's chunking
            self.chunk_rows = int(file.attrs["chunk_rows"])
        for attribute, wanted in (("capacity", self.capacity), ("chunk_rows", self.chunk_rows),
                                  ("compression", self.compression or "none")):
            if file.attrs[attribute] != wanted:
                raise UserError(f"{self.path}: {attribute} is {file.attrs[attribute]} in the file but {wanted} "
                                f"was asked for; use the file's value or a new file")

    @staticmethod
    def _mark_writer(file: h5py.File) -> None:
        file.attrs["writer_pid"] = os.getpid()
        file.attrs["writer_host"] = socket.gethostname()

    def _truncate_to_cursor(self) -> None:
        # A crash between a chunk write and its cursor update leaves rows past the cursor: they were never
        # committed, drop them so the next append lands right after the last committed row.
        rows = self.stored_rows_committed
        for dataset in self._datasets.values():
            if dataset.shape[0] != rows:
                dataset.resize(rows, axis=0)
        self._dataset_rows = rows

    # -- sizes -------------------------------------------------------------------------------------------------

    @property
    def stored_rows_committed(self) -> int:
        """Rows committed to the file (counting positions, in ring mode: at most `capacity`)."""
        return min(self._committed, self.capacity) if self.capacity else self._committed

    @property
    def total_rows(self) -> int:
        """Rows appended over the file's life, staged ones included (in ring mode, overwritten ones too)."""
        return self._committed + self._staged

    @property
    def first_row(self) -> int:
        """The oldest row that can be read now (staged rows overwrite, in memory, the rows they will replace)."""
        if not self.capacity:
            return 0
        return max(0, self._reserved - self.capacity, self.total_rows - self.capacity)

    def __len__(self) -> int:
        """Rows that can be read now: on disk or staged, at most `capacity` in ring mode."""
        return self.total_rows - self.first_row

    # -- writing -----------------------------------------------------------------------------------------------

    def append(self, td: TensorDict | Mapping, *, policy_version=-1, env_id=-1, env_step=-1) -> None:
        """Append rows (a TensorDict with batch dims, flattened to rows, or a mapping of arrays by key).

        The metadata are per-row arrays or one value for every row. A stop signal that arrives meanwhile is raised
        once the rows are staged or written (see runtime.signals_deferred), so a flush on the way out finds the
        writer consistent.
        """
        with signals_deferred():
            self._append(td, policy_version, env_id, env_step)

    def _append(self, td: TensorDict | Mapping, policy_version, env_id, env_step) -> None:
        arrays, rows = rows_of(td, self.layout)
        if rows == 0:
            return
        arrays = {f"{DATA_GROUP}/{key}": array for key, array in arrays.items()}
        for name, value in (("policy_version", policy_version), ("env_id", env_id), ("env_step", env_step)):
            value = np.asarray(value, dtype=np.int64)
            if value.shape not in ((), (rows,)):
                raise UserError(f"{name} must be one value or one per row ({rows}), got shape {value.shape}")
            arrays[f"{META_GROUP}/{name}"] = value  # one value stays 0-d: numpy broadcasts it when staged
        done = 0
        while done < rows:
            if self._staged == 0 and rows - done >= self.chunk_rows:
                # Whole chunks straight from the caller's arrays: no copy into the staging buffer.
                block = min((rows - done) // self.chunk_rows, self._chunks_per_ring()) * self.chunk_rows
                self._write({name: np.broadcast_to(array, (rows,))[done:done + block] if array.ndim == 0
                             else array[done:done + block] for name, array in arrays.items()})
                done += block
                continue
            take = min(rows - done, self.stage_rows - self._staged)
            if self._staged == 0:
                self._write_due = time.monotonic() + self.flush_every_s
            for name, array in arrays.items():
                self._staging[name][self._staged:self._staged + take] = array if array.ndim == 0 \
                    else array[done:done + take]
            self._staged += take
            done += take
            if self._staged == self.stage_rows:
                self._write_staged()
        if self._staged and time.monotonic() >= self._write_due:  # the time bound on what a crash can lose
            self._write_staged()

    def _chunks_per_ring(self) -> int:
        return self.capacity // self.chunk_rows if self.capacity else 1 << 62

    def _chunks_per_write(self) -> int:
        # Small appends are staged up to ~STAGE_BYTES and written together: each write costs two file flushes
        # (~0.3 ms each here), which would otherwise be a large share of writing one ~1 MiB chunk.
        row_bytes = sum(dtype.itemsize * int(np.prod(shape)) for shape, dtype in self._fields.values())
        return max(1, min(STAGE_BYTES // (self.chunk_rows * row_bytes), self._chunks_per_ring()))

    def flush(self) -> None:
        """Write the staged rows (even a partial chunk) and commit them."""
        with signals_deferred():
            if self._staged:
                self._write_staged()

    def rewind(self, total_rows: int) -> None:
        """Forget the rows appended after the first total_rows, e.g. to resume from a checkpoint taken then.

        In ring mode this is possible only while no row held at that point has been overwritten since.
        """
        check_rewind(self.path, total_rows, max(self.total_rows, self._reserved), self.capacity)
        with signals_deferred():
            self._rewind(total_rows)

    def _rewind(self, total_rows: int) -> None:
        self.flush()
        # Cursor first: a crash right after it leaves rows past the cursor, which reopening drops.
        self._committed = self._reserved = total_rows
        self._cursor[:] = total_rows
        self._file.flush()
        self._truncate_to_cursor()
        self._chunk_addresses.clear()  # truncation frees chunks; new ones may get new addresses
        self._file.flush()

    def _write_staged(self) -> None:
        self._write({name: staging[:self._staged] for name, staging in self._staging.items()})
        self._staged = 0

    def _write(self, arrays: dict[str, np.ndarray]) -> None:
        if self._released:
            raise UserError(f"{self.path}: closed after a failed write; no more rows can be added to it")
        try:
            self._write_and_commit(arrays)
        except (OSError, RuntimeError) as exc:  # HDF5 could not write: a full disk, a size limit, a read-only disk
            error = _write_error(self.path, exc, "cannot write rows")
            # Close at once: HDF5 crashes the interpreter at exit (SIGSEGV) if a file whose write failed is still
            # open then. The cursor still covers only rows that were written whole.
            with contextlib.suppress(OSError, RuntimeError):
                self._release()
            raise error from None

    def _write_and_commit(self, arrays: dict[str, np.ndarray]) -> None:
        rows = len(next(iter(arrays.values())))
        pieces = self._positions(self._committed, rows)
        if self.capacity and self._committed + rows > max(self.capacity, self._reserved):
            # These rows overwrite old ones: take the old ones out of the valid range before touching them.
            self._reserved = self._committed + rows
            self._cursor[1] = self._reserved
            self._file.flush()
        for start, _, count in pieces:
            if self._dataset_rows < start + count:  # every dataset has the same length: resize them together
                for dataset in self._datasets.values():
                    dataset.resize(start + count, axis=0)
                self._dataset_rows = start + count
        for name, array in arrays.items():
            for start, first, count in pieces:
                self._datasets[name][start:start + count] = array[first:first + count]
        # Rows first, then the cursor that covers them, each handed to the OS by a flush: a crash in between
        # leaves uncommitted rows past the cursor, never a cursor past its rows. (Enough for kill -9; surviving a
        # power loss would take an fsync as well.)
        self._file.flush()
        self._committed += rows
        self._reserved = max(self._reserved, self._committed)
        self._cursor[:] = (self._committed, self._reserved)
        self._file.flush()

    def _positions(self, first_row: int, rows: int) -> list[tuple[int, int, int]]:
        """(file position, offset in the block, count) pieces for rows first_row.., split where a ring wraps."""
        if not self.capacity:
            return [(first_row, 0, rows)]
        start = first_row % self.capacity
        head = min(rows, self.capacity - start)
        return [(start, 0, head)] + ([(0, head, rows - head)] if rows > head else [])

    # -- reading back (the replay buffer samples from its own writer) -------------------------------------------

    def read_rows(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        """The data rows at these indices, 0 = the oldest row held (any order, repeats allowed), staged included."""
        rows = self.first_row + np.asarray(indices, dtype=np.int64)
        unique, inverse = np.unique(rows, return_inverse=True)
        in_staging = unique >= self._committed
        on_disk = unique[~in_staging]
        positions = on_disk % self.capacity if self.capacity else on_disk
        if self.capacity and len(positions):
            positions = np.sort(positions)  # wrapped rows: increasing positions for the file reads
            on_disk_order = np.argsort(on_disk % self.capacity, kind="stable")
        out = {}
        for key in self.layout:
            name = f"{DATA_GROUP}/{key}"
            values = np.empty((len(unique), *self._staging[name].shape[1:]), self._staging[name].dtype)
            values[in_staging] = self._staging[name][unique[in_staging] - self._committed]
            if len(on_disk):
                from_file = self._read_committed(name, positions)
                if self.capacity:
                    reordered = np.empty_like(from_file)
                    reordered[on_disk_order] = from_file
                    from_file = reordered
                values[~in_staging] = from_file
            out[key] = values[inverse]
        return out

    def _read_committed(self, name: str, positions: np.ndarray) -> np.ndarray:
        """Committed rows at sorted, distinct positions.

        Uncompressed chunks hold their rows as plain C-order bytes at a fixed file address (HDF5 rewrites an
        unfiltered chunk in place), so a sampled row is one pread at chunk address + row offset: ~10x faster than
        an HDF5 selection of scattered rows, which costs ~13 us per row and dataset. Every committed row has been
        flushed to the OS, so the read sees it. Compressed files go through HDF5.
        """
        if self._direct_fd is None:
            return self._datasets[name][positions]
        shape, dtype = self._fields[name]
        rows = np.empty((len(positions), *shape), dtype)
        row_bytes = rows.reshape(len(positions), -1).view(np.uint8)
        addresses = self._chunk_addresses.setdefault(name, {})
        for index, (chunk, row_in_chunk) in enumerate(zip(*map(np.ndarray.tolist,
                                                              np.divmod(positions, self.chunk_rows)))):
            if chunk not in addresses:
                origin = (chunk * self.chunk_rows,) + (0,) * len(shape)
                addresses[chunk] = self._datasets[name].id.get_chunk_info_by_coord(origin).byte_offset
            os.preadv(self._direct_fd, [row_bytes[index]], addresses[chunk] + row_in_chunk * row_bytes.shape[1])
        return rows

    def close(self) -> None:
        if not self._released:
            try:
                self.flush()
            finally:
                try:
                    self._release()
                except (OSError, RuntimeError) as exc:  # its last metadata could not be written
                    raise _write_error(self.path, exc, "cannot close") from None

    def _release(self) -> None:
        self._released = True
        unregister_open_file(self.path)
        if self._direct_fd is not None:
            os.close(self._direct_fd)
            self._direct_fd = None
        self._file.close()

    def __enter__(self) -> "HDF5Writer":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


class HDF5Reader:
    """Read an spmd_rl experience file, also while its writer is running (SWMR): refresh() to see new rows."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._file = open_swmr_reader(self.path)
        try:
            check_format(self.path, self._file)
            self.layout = layout_from_schema(self._file.attrs["schema"])
            self.capacity = int(self._file.attrs["capacity"])
            self.attrs = dict(self._file.attrs)
            self._cursor = self._file[CURSOR]
            self.total_rows, self.reserved_rows = (int(n) for n in self._cursor[:])
        except (UserError, *DAMAGED_FILE_ERRORS) as exc:
            self._file.close()
            raise exc if isinstance(exc, UserError) else damaged(self.path, exc) from None

    def refresh(self) -> int:
        """See the rows committed since opening (or the last refresh); return the readable row count."""
        self._cursor.refresh()
        self.total_rows, self.reserved_rows = (int(n) for n in self._cursor[:])
        return len(self)

    @property
    def first_row(self) -> int:
        """The oldest valid row (0 unless a ring has overwritten rows)."""
        return max(0, self.reserved_rows - self.capacity) if self.capacity else 0

    def __len__(self) -> int:
        return self.total_rows - self.first_row

    def dataset(self, name: str) -> h5py.Dataset:
        """A dataset by its path ("data/obs", "meta/policy_version"), refreshed to the writer's latest state.

        In ring mode its positions are not in row order: read() and column() put them in order.
        """
        dataset = self._file[name]
        dataset.refresh()
        return dataset

    def column(self, name: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Valid rows [start, stop) of one dataset ("data/obs", "meta/env_step"), oldest first."""
        stop = len(self) if stop is None else min(stop, len(self))
        first = self.first_row + start
        dataset = self.dataset(name)
        if stop <= start:
            return dataset[0:0]
        if not self.capacity:
            return dataset[first:first + stop - start]
        head = first % self.capacity
        count = stop - start
        if head + count <= self.capacity:
            return dataset[head:head + count]
        return np.concatenate([dataset[head:], dataset[:head + count - self.capacity]])

    def read(self, start: int = 0, stop: int | None = None, meta: bool = False) -> dict[str, np.ndarray]:
        """Valid rows [start, stop), oldest first, as numpy arrays keyed by layout key (and meta/<name>)."""
        names = [f"{DATA_GROUP}/{key}" for key in self.layout]
        names += [f"{META_GROUP}/{name}" for name in META_FIELDS] if meta else []
        return {name.removeprefix(f"{DATA_GROUP}/"): self.column(name, start, stop) for name in names}

    def read_tensordict(self, start: int = 0, stop: int | None = None) -> TensorDict:
        arrays = self.read(start, stop)
        rows = len(next(iter(arrays.values()))) if arrays else 0
        return TensorDict({tuple(key.split("/")): torch.from_numpy(array) for key, array in arrays.items()},
                          batch_size=[rows])

    def close(self) -> None:
        if self._file.id.valid:
            self._file.close()

    def __enter__(self) -> "HDF5Reader":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


class ExperienceLog:
    """Every transition a rank's trainer consumes, appended to <run_dir>/buffer/experience_rank<R>.h5.

    Reopening a run's log continues it. Rows of a rollout [T, N, ...] are stored time-major (row t * N + n).
    """

    def __init__(self, run_dir: str | os.PathLike, rank: int, example_td: TensorDict, *,
                 chunk_rows: int | None = None, compression: str | None = None,
                 flush_every_s: float = DEFAULT_FLUSH_EVERY_S):
        self.path = Path(run_dir) / "buffer" / f"experience_rank{rank}.h5"
        self._writer = HDF5Writer(self.path, example_td, chunk_rows=chunk_rows, compression=compression,
                                  flush_every_s=flush_every_s)

    def append(self, td_rollout: TensorDict, policy_version: int, env_step: int) -> None:
        """Append a rollout shaped [T, N, ...] (or rows [B, ...]).

        env_id of row (t, n) is n, the env's index on this rank; env_step is the rank's env-step counter at the
        rollout's first step, so row (t, n) gets env_step + t * N + n: one distinct number per transition.
        """
        envs = td_rollout.batch_size[1] if td_rollout.batch_dims == 2 else 1
        rows = td_rollout.batch_size.numel()
        row = np.arange(rows, dtype=np.int64)
        self._writer.append(td_rollout, policy_version=policy_version, env_id=row % envs, env_step=env_step + row)

    @property
    def total_rows(self) -> int:
        """Rows logged so far: the cursor a checkpoint saves."""
        return self._writer.total_rows

    def rewind(self, total_rows: int) -> None:
        """Forget the rows logged after the first total_rows (resuming from a checkpoint that saved it)."""
        self._writer.rewind(total_rows)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()

    def __len__(self) -> int:
        return len(self._writer)
