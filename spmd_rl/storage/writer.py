"""Writing an experience file (its layout: schema.py): HDF5Writer, crash-safe and readable while written.

Appends are staged in memory and written as whole chunks, up to ~4 MiB at a time (tiny HDF5 writes are ~10x slower
per byte), or sooner: when the oldest staged row has waited `flush_every_s` seconds, the append that notices it
writes what is staged (checked on every append). After kill -9 the file opens and holds every row up to the last
write: what is missing was appended in the last flush_every_s seconds (plus the time since the last append). Every
orderly exit path calls fileio.flush_open_files(), which writes what every open writer has staged.

Over 400 lines: one class, whose opening checks, staged appends, time-bound flushes, rewind and shrink all keep
one invariant about the same state (the cursor, the staged rows, the file's size); split, each part would reach
into the others' attributes.
"""

from __future__ import annotations

import contextlib
import math
import os
import socket
import time
from collections.abc import Mapping
from pathlib import Path

import h5py
import numpy as np
from tensordict import TensorDict

from spmd_rl.persist.fileio import make_dirs, register_open_file, unregister_open_file
from spmd_rl.runtime.errors import UserError
from spmd_rl.runtime.signals import signals_deferred
from spmd_rl.storage.h5file import (
    DAMAGED_FILE_ERRORS,
    DamagedRows,
    check_chunks,
    clear_crash_flags,
    damaged,
    first_line,
    open_h5,
    open_swmr_reader,
    write_error,
)
from spmd_rl.storage.schema import (
    CURSOR,
    DATA_GROUP,
    FORMAT_NAME,
    FORMAT_VERSION,
    META_FIELDS,
    META_GROUP,
    Field,
    check_bounds,
    check_format,
    layout_from_schema,
    layout_of,
    rows_of,
    schema_difference,
    schema_json,
    valid_positions,
)

COMPRESSIONS = (None, "lzf")  # fast codecs only: gzip writes at 30-70 MB/s, far below the hot path
STAGE_BYTES = 4 << 20  # small appends are staged in memory up to this many bytes (whole chunks) per write
DEFAULT_FLUSH_EVERY_S = 2.0  # staged rows wait at most this long before an append writes them (config default)


def default_chunk_rows(layout: dict[str, Field]) -> int:
    """About 1 MiB of rows per chunk (a power of two, 64..16384 rows): big enough that the per-chunk cost (resize,
    write, two flushes, ~1 ms here) stays small against the bytes written, small enough to stage in memory."""
    row_bytes = sum(dtype.itemsize * int(np.prod(shape)) for shape, dtype in layout.values()) + 8 * len(META_FIELDS)
    rows = 1 << max(0, (2**20 // row_bytes).bit_length() - 1)
    return max(64, min(16384, rows))


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
        raise UserError(
            f"{where}: cannot rewind to {total_rows} rows, the checkpoint's count; it holds only {appended} (it was "
            f"replaced or cut short since): restore it from a copy, or remove the run's checkpoints/ to start over"
        )
    overwritten = appended - max(total_rows, capacity) if capacity else 0
    if overwritten > 0:
        raise UserError(
            f"{where}: cannot rewind to {total_rows} rows: {overwritten} of the rows held then have "
            f"been overwritten since (ring of {capacity} rows)"
        )


def _check_present(path: Path, must_exist: bool) -> None:
    """A file that is gone (must_exist: a resume's checkpoint counts rows in it) or empty is refused as it is, never
    replaced by a new one."""
    if must_exist and not path.exists():
        raise UserError(
            f"{path} is missing, but the checkpoint this run resumes from counts rows in it: restore it from a copy, "
            f"or remove the run's checkpoints/ to start over"
        )
    if path.is_file() and path.stat().st_size == 0:
        raise UserError(
            f"{path} is empty (0 bytes: a full disk, or a copy cut short); the rows it held are lost: restore it "
            f"from a copy, or remove it and the run's checkpoints/ to start over"
        )


class HDF5Writer:
    """Append rows of a fixed layout to one HDF5 file, in whole chunks, crash-safe and readable while written.

    Opening an existing file continues it (contents and cursor are restored) if its layout, capacity and chunking
    match; a different layout is a UserError naming the file, the key and the difference. `capacity` makes it a
    ring of that many rows (the replay buffer); None grows without bound (the experience log). chunk_rows None
    or 0 picks about 1 MiB of rows per chunk for a new file and keeps an existing file's. Staged rows are written
    once the oldest has waited flush_every_s seconds (0: every append writes; math.inf: only whole stages).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        layout: Mapping | TensorDict,
        *,
        chunk_rows: int | None = None,
        compression: str | None = None,
        capacity: int | None = None,
        overwrite: bool = False,
        flush_every_s: float = DEFAULT_FLUSH_EVERY_S,
        attributes: Mapping | None = None,
        must_exist: bool = False,
    ):
        self.attributes = dict(attributes or {})  # extra attributes of / for a new file (an existing one has them)
        if not flush_every_s >= 0:  # also refuses NaN
            raise UserError(f"buffer.flush_every_s must be >= 0 (0: write on every append), got {flush_every_s}")
        if compression not in COMPRESSIONS:
            raise UserError(
                f"HDF5 compression {compression!r} is not supported; choose one of {COMPRESSIONS} "
                f"(gzip is too slow for appends on the training path)"
            )
        if (chunk_rows or 0) < 0 or (capacity is not None and capacity < 1):
            raise UserError(
                f"HDF5 chunk_rows ({chunk_rows}) must be >= 0 (0: automatic) and capacity ({capacity}) at least 1"
            )
        self.path = Path(path)
        _check_present(self.path, must_exist and not overwrite)  # before anything could replace it
        register_open_file(self.path, self)
        existed = self.path.exists() and not overwrite
        try:
            self._open(layout, chunk_rows, compression, capacity, overwrite, flush_every_s)
        except BaseException as exc:
            unregister_open_file(self.path)
            file = getattr(self, "_file", None)
            if file is not None and file.id.valid:
                with contextlib.suppress(*DAMAGED_FILE_ERRORS):
                    file.close()
            if isinstance(exc, DAMAGED_FILE_ERRORS):  # h5py's errors escape as user-code errors (exit 4) otherwise
                raise damaged(self.path, exc) if existed else write_error(self.path, exc, "cannot create") from None
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
        self._damage = self._find_damage()
        if self._damage is None:
            self._truncate_to_cursor()
        else:
            # Shrinking rewrites the last chunk kept through its filter: on the damaged chunk HDF5 would fail without
            # naming rows. Left to the rewind, which drops damage past its checkpoint, or to the first use, which
            # raises the damage (_check_rows).
            self._dataset_rows = next(iter(self._datasets.values())).shape[0]
        self._file.swmr_mode = True  # from here on: no new objects or attributes, readers may attach
        self.stage_rows = self.chunk_rows * self._chunks_per_write()
        self._staging = {
            name: np.empty((self.stage_rows, *shape), dtype) for name, (shape, dtype) in self._fields.items()
        }
        self._staged = 0
        self._write_due = math.inf  # monotonic time by which the staged rows are to be written
        self._direct_fd = os.open(self.path, os.O_RDONLY) if compression is None else None
        self._chunk_addresses: dict[str, dict[int, int]] = {}
        self._released = False  # closed, or given up after a failed write

    # -- opening -----------------------------------------------------------------------------------------------

    def _create(self) -> h5py.File:
        file = open_h5(self.path, "w", libver="latest", **self._chunk_cache)
        for name, (shape, dtype) in self._fields.items():
            file.create_dataset(
                name,
                shape=(0, *shape),
                maxshape=(self.capacity or None, *shape),
                dtype=dtype,
                chunks=(self.chunk_rows, *shape),
                compression=self.compression,
                fletcher32=True,  # a checksum per chunk: damaged rows are found (see _check_rows)
            )
        # Chunked only so that it can carry a checksum too: a damaged cursor could otherwise look plausible.
        file.create_dataset(CURSOR, data=np.zeros(2, dtype=np.int64), chunks=(2,), fletcher32=True)
        file.attrs.update(
            {
                "format": FORMAT_NAME,
                "format_version": FORMAT_VERSION,
                "schema": schema_json(self.layout),
                "capacity": self.capacity,
                "chunk_rows": self.chunk_rows,
                "compression": self.compression or "none",
                **self.attributes,
            }
        )
        self._mark_writer(file)
        return file

    def _open_existing(self) -> h5py.File:
        try:
            file = h5py.File(self.path, "r+", libver="latest", **self._chunk_cache)
        except OSError as exc:
            if "already open for write" not in str(exc):
                raise UserError(f"{self.path} is not a readable HDF5 file: {first_line(exc)}") from exc
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
        check_bounds(self.path, file)  # before anything is allocated from its attributes
        difference = schema_difference(self.path, layout_from_schema(file.attrs["schema"], self.path), self.layout)
        if difference:
            raise UserError(difference)
        if not self._chunk_rows_asked:  # not asked for: continue with the file's chunking
            self.chunk_rows = int(file.attrs["chunk_rows"])
        for attribute, wanted in (
            ("capacity", self.capacity),
            ("chunk_rows", self.chunk_rows),
            ("compression", self.compression or "none"),
        ):
            if file.attrs[attribute] != wanted:
                raise UserError(
                    f"{self.path}: {attribute} is {file.attrs[attribute]} in the file but {wanted} "
                    f"was asked for; use the file's value or a new file"
                )

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
                self._write(
                    {
                        name: np.broadcast_to(array, (rows,))[done : done + block]
                        if array.ndim == 0
                        else array[done : done + block]
                        for name, array in arrays.items()
                    }
                )
                done += block
                continue
            take = min(rows - done, self.stage_rows - self._staged)
            if self._staged == 0:
                self._write_due = time.monotonic() + self.flush_every_s
            for name, array in arrays.items():
                self._staging[name][self._staged : self._staged + take] = (
                    array if array.ndim == 0 else array[done : done + take]
                )
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
        self._check_usable()
        check_rewind(self.path, total_rows, max(self.total_rows, self._reserved), self.capacity)
        # Resuming: damage found at opening in the rows the checkpoint names is raised now, not at the first sample,
        # and before the truncation, which rewrites the last chunk kept (HDF5 would fail without naming rows).
        self._check_rows(until=total_rows)
        with signals_deferred():
            try:
                self._rewind(total_rows)
            except DAMAGED_FILE_ERRORS as exc:
                raise write_error(self.path, exc, "cannot rewind") from None

    def _rewind(self, total_rows: int) -> None:
        self.flush()
        # Cursor first: a crash right after it leaves rows past the cursor, which reopening drops.
        self._committed = self._reserved = total_rows
        self._cursor[:] = total_rows
        self._file.flush()
        self._truncate_to_cursor()
        self._chunk_addresses.clear()  # truncation frees chunks; new ones may get new addresses
        self._file.flush()

    def _find_damage(self) -> tuple[int, DamagedRows] | None:
        """Verify the checksums of every valid row of an opened file (~0.5 GB/s, benchmarks/README.md): the first
        damaged position and its error (naming the file, dataset and rows), or None.

        Done at opening, before SWMR mode: a SWMR writer retries a failed metadata read ~100 times with growing
        sleeps (hours; H5Pset_metadata_read_attempts does not bound it), a plain one fails at once. The damage is
        raised when the rows are used (_check_rows), so that a resume can still drop damaged rows past its
        checkpoint. Sampled reads (_read_committed) skip the checksums: their rows were checked here or written by
        this process."""
        found = None
        for start, stop in valid_positions(self.capacity, self._committed, self._reserved):
            for name in self._datasets:
                try:
                    check_chunks(self.path, self._datasets[name], start, stop)
                except DamagedRows as exc:  # rows before exc.first of this dataset are sound: go on with the next
                    found = min(found or (exc.first, exc), (exc.first, exc), key=lambda pair: pair[0])
                    self._reopen()  # after a failed read HDF5's state can be wrong (see check_chunks)
            if found:  # checked in position order: a ring's second range is past the damage
                break
        return found

    def _reopen(self) -> None:
        self._file.close()
        self._file = open_h5(self.path, "r+", libver="latest", **self._chunk_cache)
        self._datasets = {name: self._file[name] for name in self._fields}
        self._cursor = self._file[CURSOR]

    def _check_rows(self, until: int | None = None) -> None:
        """Raise the damage found at opening if it lies in the rows used: all valid rows, or those a rewind to
        `until` keeps (in a ring that has wrapped, rows are not in position order: any damage there)."""
        if self._damage is None:
            return
        first, error = self._damage
        in_order = not self.capacity or self._reserved <= self.capacity
        if until is not None and in_order and first >= until:
            self._damage = None  # past the rows kept: the rewind's truncation drops those chunks unread
            return
        # Given up, as after a failed write: the exit path's flush (fileio.flush_open_files) must not write into
        # the damaged file, nor report it a second time.
        with contextlib.suppress(*DAMAGED_FILE_ERRORS):
            self._release()
        # removing the file alone would be refused next (the checkpoint counts rows in it: _check_present)
        raise UserError(
            f"{error.problem}; restore it from a copy, or remove it and the run's checkpoints/ to start over"
        )

    def _write_staged(self) -> None:
        self._write({name: staging[: self._staged] for name, staging in self._staging.items()})
        self._staged = 0

    def _write(self, arrays: dict[str, np.ndarray]) -> None:
        self._check_usable()
        try:
            self._write_and_commit(arrays)
        except (OSError, RuntimeError) as exc:  # HDF5 could not write: a full disk, a size limit, a read-only disk
            error = write_error(self.path, exc, "cannot write rows")
            # Close at once: HDF5 crashes the interpreter at exit (SIGSEGV) if a file whose write failed is still
            # open then. The cursor still covers only rows that were written whole.
            with contextlib.suppress(OSError, RuntimeError):
                self._release()
            raise error from None

    def _check_usable(self) -> None:
        if self._released:
            raise UserError(f"{self.path}: closed after a failed write or damage found; it cannot be used any more")

    def _write_and_commit(self, arrays: dict[str, np.ndarray]) -> None:
        self._check_rows()
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
                self._datasets[name][start : start + count] = array[first : first + count]
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
        self._check_usable()
        self._check_rows()
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
                try:
                    from_file = self._read_committed(name, positions)
                except DAMAGED_FILE_ERRORS as exc:  # damaged since it was checked: say which rows if HDF5 can
                    check_chunks(self.path, self._datasets[name], int(positions[0]), int(positions[-1]) + 1)
                    raise damaged(self.path, exc) from None
                if self.capacity:
                    reordered = np.empty_like(from_file)
                    reordered[on_disk_order] = from_file
                    from_file = reordered
                values[~in_staging] = from_file
            out[key] = values[inverse]
        return out

    def _read_committed(self, name: str, positions: np.ndarray) -> np.ndarray:
        """Committed rows at sorted, distinct positions.

        Uncompressed chunks hold their rows as plain C-order bytes (then fletcher32's 4-byte checksum) at a fixed
        file address (HDF5 rewrites a chunk in place while its filtered size stays the same), so a sampled row is
        one pread at chunk address + row offset: ~10x faster than an HDF5 selection of scattered rows, which costs
        ~13 us per row and dataset. Every committed row has been flushed to the OS, so the read sees it. The read
        skips the checksum, which covers the whole chunk: the rows were checked once (_check_rows) or written by
        this process. Compressed files go through HDF5, which checks each chunk it reads.
        """
        if self._direct_fd is None:
            return self._datasets[name][positions]
        shape, dtype = self._fields[name]
        rows = np.empty((len(positions), *shape), dtype)
        row_bytes = rows.reshape(len(positions), -1).view(np.uint8)
        addresses = self._chunk_addresses.setdefault(name, {})
        for index, (chunk, row_in_chunk) in enumerate(
            zip(*map(np.ndarray.tolist, np.divmod(positions, self.chunk_rows)))
        ):
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
                    raise write_error(self.path, exc, "cannot close") from None

    def _release(self) -> None:
        self._released = True
        unregister_open_file(self.path)
        if self._direct_fd is not None:
            os.close(self._direct_fd)
            self._direct_fd = None
        self._file.close()

    def __enter__(self) -> HDF5Writer:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
