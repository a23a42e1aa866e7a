"""The layout of an spmd_rl experience file, the rows checked against it, and the format check.

Experience on disk: one HDF5 file per writing rank, readable with plain h5py while it is being written
(writer.py writes it, reader.py reads it, h5file.py opens it).

File layout (format "spmd_rl.hdf5", version 1):

    /data/<key>            one chunked dataset per TensorDict leaf, shape (rows, *leaf_shape); nested keys are
                           groups (("next", "obs") -> /data/next/obs)
    /meta/policy_version   int64 per row: the policy version that acted (-1 = not recorded)
    /meta/env_id           int64 per row: the env's index on the writing rank (-1 = not recorded)
    /meta/env_step         int64 per row: the rank's env-step counter for the row, in primitive steps (-1 = not
                           recorded)
    /cursor                int64[2]: [committed, reserved] row counts over the file's life (see below)
    attributes of /        format, format_version, schema (JSON: key -> shape, numpy dtype string), capacity
                           (0 = grows without bound, else a ring of that many rows), chunk_rows, compression,
                           writer_pid, writer_host (the last process that opened it for writing)

Every dataset, the cursor included, is chunked with HDF5's fletcher32 filter: a checksum per chunk that HDF5 checks
on every read through its filter pipeline (files written before issue 19 have none and are read unchecked; see
h5file.check_chunks and writer.HDF5Writer._find_damage).

Row r (counting from the file's first row) is stored at position r, or r % capacity in ring mode. The valid rows
are r in [max(0, reserved - capacity), committed) in ring mode, [0, committed) otherwise (reserved == committed
there). Rows are written first and `committed` raised after them; before a ring write overwrites old rows,
`reserved` is raised past it, which takes the rows about to be overwritten out of the valid range. Each step is
followed by a file flush, so a reader, or the file after kill -9, never sees a row that is not whole; a crash in
the middle of a ring write just leaves fewer valid rows, until later writes pass `reserved`. The cursor lives in a
dataset rather than in attributes because the file is kept in SWMR mode (single writer, many readers): readers
refresh datasets to see new rows.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import torch
from tensordict import TensorDict

from spmd_rl.runtime.errors import UserError

FORMAT_NAME = "spmd_rl.hdf5"
FORMAT_VERSION = 1
DATA_GROUP = "data"
META_GROUP = "meta"
CURSOR = "cursor"
META_FIELDS = ("policy_version", "env_id", "env_step")

# A field of the layout: the shape of one row and its numpy dtype.
Field = tuple[tuple[int, ...], np.dtype]

_TORCH_TO_NUMPY = {
    torch.float16: np.float16,
    torch.float32: np.float32,
    torch.float64: np.float64,
    torch.int8: np.int8,
    torch.int16: np.int16,
    torch.int32: np.int32,
    torch.int64: np.int64,
    torch.uint8: np.uint8,
    torch.bool: np.bool_,
}


def layout_of(spec: Mapping | TensorDict) -> dict[str, Field]:
    """Normalize a layout: {key: (shape, dtype)} or an example TensorDict (its batch dims are the row dims).

    Keys become "/"-joined paths ("next/obs" for ("next", "obs")); dtypes become numpy dtypes.
    """
    if isinstance(spec, TensorDict):
        rows_dims = spec.batch_dims
        return {
            _path(key): (tuple(value.shape[rows_dims:]), _numpy_dtype(value.dtype, key))
            for key, value in spec.items(include_nested=True, leaves_only=True)
        }
    layout = {}
    for key, (shape, dtype) in spec.items():
        dtype = _numpy_dtype(dtype, key) if isinstance(dtype, torch.dtype) else np.dtype(dtype)
        layout[_path(key)] = (tuple(int(n) for n in shape), dtype)
    return layout


def _path(key) -> str:
    return "/".join(key) if isinstance(key, tuple) else str(key)


def _numpy_dtype(dtype: torch.dtype, key) -> np.dtype:
    if dtype not in _TORCH_TO_NUMPY:
        raise UserError(
            f"key {_path(key)!r} has dtype {dtype}, which HDF5 storage does not support; "
            f"supported: {', '.join(str(d) for d in _TORCH_TO_NUMPY)}"
        )
    return np.dtype(_TORCH_TO_NUMPY[dtype])


def schema_json(layout: dict[str, Field]) -> str:
    return json.dumps(
        {key: {"shape": list(shape), "dtype": dtype.str} for key, (shape, dtype) in layout.items()}, sort_keys=True
    )


def layout_from_schema(text: str, path: Path | str = "the experience file") -> dict[str, Field]:
    """The layout the schema attribute (JSON) states; a UserError naming the file and the dataset when a field is
    not one spmd_rl writes (a crafted or damaged file: an unknown dtype, a shape that is no list of sizes)."""
    try:
        schema = json.loads(text)
    except (TypeError, ValueError):
        schema = None
    if not isinstance(schema, dict):
        raise UserError(f"{path}: its schema attribute is not a JSON object; restore the file or remove it")
    written = {np.dtype(numpy_type).str for numpy_type in _TORCH_TO_NUMPY.values()}
    layout = {}
    for key, field in schema.items():
        shape = field.get("shape") if isinstance(field, dict) else None
        dtype = field.get("dtype") if isinstance(field, dict) else None
        if dtype not in written:
            raise UserError(
                f"{path}: dataset '{key}' has dtype {str(dtype)[:40]!r} in the schema attribute, which spmd_rl "
                f"never writes (it writes {', '.join(sorted(written))}); the file is damaged or not one of ours: "
                f"restore it from a copy or remove it"
            )
        if not isinstance(shape, list) or not all(isinstance(n, int) and 0 <= n < 1 << 31 for n in shape):
            raise UserError(
                f"{path}: dataset '{key}' has shape {str(shape)[:40]} in the schema attribute, which is no list of "
                f"sizes; the file is damaged or not one of ours: restore it from a copy or remove it"
            )
        layout[key] = (tuple(shape), np.dtype(dtype))
    return layout


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
            return (
                f"{path}: key {key!r} is {describe_field(file_layout[key])} in the file but "
                f"{describe_field(wanted[key])} in the new layout"
            )
    return None


def rows_of(td: TensorDict | Mapping, layout: dict[str, Field]) -> tuple[dict[str, np.ndarray], int]:
    """The numpy arrays of a batch of rows, keyed by path, checked against the layout; and the row count.

    This runs on every append, so it is kept to one pass over the leaves (~15 us for five keys).
    """
    if isinstance(td, TensorDict):
        td = td.reshape(-1) if td.batch_dims != 1 else td
        items: Iterable[tuple[Any, Any]] = td.items(include_nested=True, leaves_only=True)
    else:
        items = td.items()
    arrays = {
        key if isinstance(key, str) else "/".join(key): value.numpy(force=True)
        if isinstance(value, torch.Tensor)
        else np.asarray(value)
        for key, value in items
    }
    if arrays.keys() != layout.keys():
        missing, extra = sorted(layout.keys() - arrays.keys()), sorted(arrays.keys() - layout.keys())
        raise UserError(f"rows do not match the storage layout: missing keys {missing}, unexpected keys {extra}")
    first = next(iter(arrays.values()), None)
    rows = first.shape[0] if first is not None and first.ndim else 0
    for key, (shape, dtype) in layout.items():
        array = arrays[key]
        if array.shape[1:] != shape or array.dtype != dtype or array.shape[:1] != (rows,):
            raise UserError(
                f"key {key!r}: rows are {array.dtype.name}{list(array.shape)} (rows first), the storage "
                f"layout says {describe_field((shape, dtype))} per row, {rows} rows like the first key"
            )
    return arrays, rows


def valid_positions(capacity: int, committed: int, reserved: int) -> list[tuple[int, int]]:
    """The dataset positions [start, stop) that hold the valid rows (one range, or two where a ring wraps)."""
    if not capacity:
        return [(0, committed)] if committed else []
    first = max(0, reserved - capacity)
    if committed <= first:
        return []
    start, stop = first % capacity, (committed - 1) % capacity + 1
    return [(start, stop)] if start < stop else [(start, capacity), (0, stop)]


MAX_CHUNK_ROWS = 2**22  # buffer.chunk_rows' own bound: a file claiming more was not written by spmd_rl
MAX_CAPACITY = 2**40  # rows of a ring; far beyond any disk, small enough that no count of it overflows int64


def check_bounds(path: Path, file: h5py.File) -> tuple[int, int, int, int]:
    """The file's capacity, chunk_rows and cursor (committed, reserved), checked against sane bounds and against
    its datasets before anything is allocated from them; a UserError naming the file when they do not hold.

    An spmd_rl writer keeps: 1 <= chunk_rows <= MAX_CHUNK_ROWS, the datasets chunked by chunk_rows rows; every
    dataset holding at least the committed rows (rows are written before the cursor that covers them); reserved
    == committed without a ring, committed <= reserved <= committed + capacity in one."""

    def bad(what: str) -> UserError:
        return UserError(f"{path} is damaged or was not written by spmd_rl: {what}; restore it or remove it")

    def integer(name: str, value) -> int:
        if isinstance(value, np.ndarray) and value.shape == ():
            value = value.item()
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            raise bad(f"its {name} attribute is not an integer")
        return int(value)

    capacity = integer("capacity", file.attrs.get("capacity"))
    chunk_rows = integer("chunk_rows", file.attrs.get("chunk_rows"))
    if not 0 <= capacity <= MAX_CAPACITY:
        raise bad(f"capacity {capacity} is outside [0, {MAX_CAPACITY}]")
    if not 1 <= chunk_rows <= MAX_CHUNK_ROWS:
        raise bad(f"chunk_rows {chunk_rows} is outside [1, {MAX_CHUNK_ROWS}]")
    cursor = file.get(CURSOR)
    if not isinstance(cursor, h5py.Dataset) or cursor.shape != (2,) or cursor.dtype.kind not in "iu":
        raise bad(f"its /{CURSOR} is not two integers")
    committed, reserved = (int(n) for n in cursor[:])
    if committed < 0 or not committed <= reserved <= committed + capacity:
        raise bad(f"its cursor [{committed}, {reserved}] is impossible (capacity {capacity})")
    stored = min(committed, capacity) if capacity else committed
    datasets = [file.get(f"{group}/{name}") for group, names in _dataset_names(file) for name in names]
    if not datasets or not all(isinstance(d, h5py.Dataset) for d in datasets):
        raise bad("its datasets are missing")
    for dataset in datasets:
        if file.swmr_mode:  # a reader while the writer appends: see the datasets as they are now
            dataset.refresh()
        if dataset.chunks is None or dataset.chunks[0] != chunk_rows:
            raise bad(f"{dataset.name} is chunked by {dataset.chunks}, not by chunk_rows {chunk_rows}")
        if dataset.shape[0] < stored:
            raise bad(f"its cursor counts {committed} rows but {dataset.name} holds {dataset.shape[0]}")
    # Every committed row was written, so its chunk exists: a cursor over unwritten (sparse) rows is crafted.
    written = datasets[-1].id.get_num_chunks() * chunk_rows
    if written < stored:
        raise bad(f"its cursor counts {committed} rows but {datasets[-1].name} has only {written} rows written")
    return capacity, chunk_rows, committed, reserved


def _dataset_names(file: h5py.File) -> list[tuple[str, list[str]]]:
    """(group, dataset paths in it) for the data and meta groups, as the schema attribute and META_FIELDS say."""
    try:
        schema = json.loads(file.attrs["schema"])
    except (KeyError, TypeError, ValueError):
        schema = None
    if not isinstance(schema, dict):
        raise UserError(f"{file.filename}: its schema attribute is not a JSON object; restore it or remove it")
    keys = list(schema)
    return [(DATA_GROUP, keys), (META_GROUP, list(META_FIELDS))]


def check_format(path: Path, file: h5py.File) -> None:
    if file.attrs.get("format") != FORMAT_NAME:
        raise UserError(
            f"{path} is an HDF5 file but not an spmd_rl experience file (no format={FORMAT_NAME} attribute)"
        )
    version = int(file.attrs.get("format_version", -1))
    if version != FORMAT_VERSION:
        raise UserError(f"{path} has format version {version}; this spmd_rl reads version {FORMAT_VERSION}")
