"""Reading an experience file (its layout: schema.py), also while its writer is running."""

from __future__ import annotations

import os
from pathlib import Path

import h5py
import numpy as np
import torch
from tensordict import TensorDict

from spmd_rl.runtime.errors import UserError
from spmd_rl.storage.h5file import DAMAGED_FILE_ERRORS, check_chunks, damaged, open_swmr_reader
from spmd_rl.storage.schema import (
    CURSOR,
    DATA_GROUP,
    META_FIELDS,
    META_GROUP,
    check_bounds,
    check_format,
    layout_from_schema,
    valid_positions,
)


class HDF5Reader:
    """Read an spmd_rl experience file, also while its writer is running (SWMR): refresh() to see new rows."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._file = open_swmr_reader(self.path)
        try:
            check_format(self.path, self._file)
            check_bounds(self.path, self._file)  # a crafted cursor or attribute: refused before any scan
            self.layout = layout_from_schema(self._file.attrs["schema"], self.path)
            self.capacity = int(self._file.attrs["capacity"])
            self.attrs = dict(self._file.attrs)
            self._cursor = self._file[CURSOR]
            self.total_rows, self.reserved_rows = (int(n) for n in self._cursor[:])
        except (UserError, *DAMAGED_FILE_ERRORS) as exc:
            self._file.close()
            raise exc if isinstance(exc, UserError) else damaged(self.path, exc) from None

    def refresh(self) -> int:
        """See the rows committed since opening (or the last refresh); return the readable row count."""
        try:
            self._cursor.refresh()
            self.total_rows, self.reserved_rows = (int(n) for n in self._cursor[:])
        except DAMAGED_FILE_ERRORS as exc:
            raise damaged(self.path, exc) from None
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
        try:
            dataset = self._file[name]
            dataset.refresh()
        except DAMAGED_FILE_ERRORS as exc:
            raise damaged(self.path, exc) from None
        return dataset

    def column(self, name: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Valid rows [start, stop) of one dataset ("data/obs", "meta/env_step"), oldest first."""
        stop = len(self) if stop is None else min(stop, len(self))
        first = self.first_row + start
        if stop <= start:
            return self._positions(name, 0, 0)
        if not self.capacity:
            return self._positions(name, first, first + stop - start)
        head = first % self.capacity
        count = stop - start
        if head + count <= self.capacity:
            return self._positions(name, head, head + count)
        return np.concatenate(
            [self._positions(name, head, self.capacity), self._positions(name, 0, head + count - self.capacity)]
        )

    def _positions(self, name: str, low: int, high: int) -> np.ndarray:
        """The dataset's positions [low:high]; a chunk that fails its checksum (or cannot be read) is a UserError
        naming its rows. By name, not handle: a failed read reopens the file, which closes every handle."""
        try:
            return self.dataset(name)[low:high]
        except DAMAGED_FILE_ERRORS:
            pass
        # After a failed read HDF5's state can be wrong (see check_chunks): look again through a fresh handle.
        self._file.close()
        self._file = open_swmr_reader(self.path)
        self._cursor = self._file[CURSOR]
        dataset = self.dataset(name)
        check_chunks(self.path, dataset, low, high)  # passes if a chunk was read while the writer rewrote it
        try:
            return dataset[low:high]
        except DAMAGED_FILE_ERRORS as exc:
            raise damaged(self.path, exc) from None

    def check_rows(self) -> bool:
        """Verify the checksums of every valid row of every dataset (~0.5 GB/s); a damaged chunk is a UserError naming
        the file, the dataset and its rows. False if the file has no checksums (written before spmd_rl had them)."""
        names = [f"{DATA_GROUP}/{key}" for key in self.layout] + [f"{META_GROUP}/{name}" for name in META_FIELDS]
        datasets = [self.dataset(name) for name in names]
        for start, stop in valid_positions(self.capacity, self.total_rows, self.reserved_rows):
            for dataset in datasets:
                check_chunks(self.path, dataset, start, stop)
        return any(dataset.fletcher32 for dataset in datasets)

    def read(self, start: int = 0, stop: int | None = None, meta: bool = False) -> dict[str, np.ndarray]:
        """Valid rows [start, stop), oldest first, as numpy arrays keyed by layout key (and meta/<name>)."""
        names = [f"{DATA_GROUP}/{key}" for key in self.layout]
        names += [f"{META_GROUP}/{name}" for name in META_FIELDS] if meta else []
        return {name.removeprefix(f"{DATA_GROUP}/"): self.column(name, start, stop) for name in names}

    def read_tensordict(self, start: int = 0, stop: int | None = None) -> TensorDict:
        arrays = self.read(start, stop)
        rows = len(next(iter(arrays.values()))) if arrays else 0
        return TensorDict(
            {tuple(key.split("/")): torch.from_numpy(array) for key, array in arrays.items()}, batch_size=[rows]
        )

    def close(self) -> None:
        if self._file.id.valid:
            self._file.close()

    def __enter__(self) -> HDF5Reader:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
