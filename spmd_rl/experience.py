"""Look at a run's experience files: `python -m spmd_rl.experience inspect RUN_DIR` (or one .h5 file).

Prints, per file: rows, keys with shapes and dtypes, the policy version range, the episode count (ends of episodes
from a done / terminated / truncated key when there is one), the size on disk, and whether every row passed its
checksum (all rows are read: ~0.5 GB/s). A missing directory, a corrupt file, rows that fail their checksum or a file
that is not an spmd_rl experience file is a one-line error and exit code 2 (damaged rows: the file, the dataset and
the row range); a truncated or corrupt file is found within seconds (see storage.h5file.open_swmr_reader).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from spmd_rl.config.excerpts import clip
from spmd_rl.persist.fileio import file_kind
from spmd_rl.runtime.errors import USER_ERROR_EXIT_CODE, UserError
from spmd_rl.storage.h5file import DAMAGED_FILE_ERRORS, damaged
from spmd_rl.storage.reader import HDF5Reader
from spmd_rl.storage.schema import describe_field

EPISODE_END_KEYS = ("done", "terminated", "truncated")
SCAN_ROWS = 1 << 20  # read columns in slices this long, so inspecting a huge file needs little memory


def experience_files(target: Path) -> list[Path]:
    """The .h5 files of a run: RUN_DIR/buffer/*.h5, else RUN_DIR/*.h5, or the file itself."""
    if target.is_file():
        return [target]
    if not target.exists():
        raise UserError(f"{target}: no such run directory or file")
    if not target.is_dir():  # a FIFO or a device: reading it would wait or never end
        raise UserError(f"{target} is {file_kind(target.stat().st_mode)}: give an HDF5 file or a run directory")
    files = sorted((target / "buffer").glob("*.h5")) or sorted(target.glob("*.h5"))
    if not files:
        raise UserError(f"{target}: no experience files (looked for buffer/*.h5 and *.h5)")
    return files


def summarize(path: Path) -> str:
    if not path.is_file():  # a run directory's buffer/*.h5 that is a FIFO or a device: opening it would wait
        kind = file_kind(path.stat().st_mode) if path.exists() else "a symlink to nothing"
        raise UserError(f"{path} is {kind}, not an HDF5 file: move it away, or restore the file from a copy")
    try:
        return _summary(path)
    except DAMAGED_FILE_ERRORS as exc:
        raise damaged(path, exc) from None


def _summary(path: Path) -> str:
    with HDF5Reader(path) as reader:
        rows = len(reader)
        capacity = f", ring of {reader.capacity}" if reader.capacity else ""
        lines = [
            f"{path}  ({rows} rows{capacity}, {reader.total_rows} appended, "
            f"{_human_bytes(path.stat().st_size)} on disk, compression {reader.attrs['compression']})"
        ]
        width = max(len(key) for key in reader.layout) if reader.layout else 0
        for key, field in sorted(reader.layout.items()):
            lines.append(f"  {key:<{width}}  {describe_field(field)}")
        versions = _min_max(reader, "meta/policy_version", rows)
        lines.append(
            "  policy versions: -"
            if versions is None
            else "  policy versions: not recorded"
            if versions == (-1, -1)
            else f"  policy versions: {versions[0]}..{versions[1]}"
        )
        if "group_names" in reader.attrs:  # an env-group run's file: its rows per group
            lines.append(f"  env groups: {_group_rows(reader, rows)}")
        keys, episodes = _episode_ends(reader, rows)
        lines.append(
            f"  episodes ended: {episodes} (rows with {' or '.join(keys)} set)"
            if keys
            else "  episodes ended: - (no done/terminated/truncated key)"
        )
        lines.append(
            "  checksums: every row verified (fletcher32)"
            if reader.check_rows()
            else "  checksums: none (a file written before spmd_rl checksummed its rows): not verified"
        )
    return "\n".join(lines)


def _min_max(reader: HDF5Reader, name: str, rows: int) -> tuple[int, int] | None:
    if rows == 0:
        return None
    low, high = None, None
    for start in range(0, rows, SCAN_ROWS):
        column = reader.column(name, start, start + SCAN_ROWS)
        low = column.min() if low is None else min(low, column.min())
        high = column.max() if high is None else max(high, column.max())
    assert low is not None and high is not None  # the file has rows
    return int(low), int(high)


def _group_rows(reader: HDF5Reader, rows: int) -> str:
    """'short 80 rows, long 160 rows' from the group column and the file's group_names attribute."""
    try:
        names = json.loads(reader.attrs["group_names"])
    except (TypeError, ValueError):
        names = None
    if not isinstance(names, list) or not all(isinstance(name, str) for name in names) or "group" not in reader.layout:
        return "unreadable (the group_names attribute or the group column is not what spmd_rl writes)"
    counts = np.zeros(len(names) + 1, dtype=np.int64)  # the last slot: indices no name is given for
    for start in range(0, rows, SCAN_ROWS):
        column = reader.column("data/group", start, start + SCAN_ROWS).astype(np.int64)
        known = (column >= 0) & (column < len(names))
        counts[: len(names)] += np.bincount(column[known], minlength=len(names))
        counts[-1] += int((~known).sum())
    listed = [f"{clip(name)} {count} rows" for name, count in zip(names, counts[:-1], strict=True)]
    return ", ".join(listed + ([f"{counts[-1]} rows of no group"] if counts[-1] else []))


def _episode_ends(reader: HDF5Reader, rows: int) -> tuple[list[str], int]:
    # An episode ends where any of done / terminated / truncated is set (at any nesting, e.g. next/done).
    keys = [key for key in reader.layout if key.split("/")[-1] in EPISODE_END_KEYS and reader.layout[key][0] == ()]
    if not keys:
        return keys, 0
    count = 0
    for start in range(0, rows, SCAN_ROWS):
        stop = min(rows, start + SCAN_ROWS)
        ended = np.zeros(stop - start, dtype=bool)
        for key in keys:
            ended |= reader.column(f"data/{key}", start, stop).astype(bool)
        count += int(ended.sum())
    return keys, count


def _human_bytes(size: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m spmd_rl.experience", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    inspect = commands.add_parser("inspect", help="summarize a run's experience files")
    inspect.add_argument("run_dir", type=Path, help="run directory (its buffer/*.h5) or one .h5 file")
    args = parser.parse_args(argv)
    try:
        for path in experience_files(args.run_dir):
            print(summarize(path))
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return USER_ERROR_EXIT_CODE
    return 0


if __name__ == "__main__":
    sys.exit(main())
