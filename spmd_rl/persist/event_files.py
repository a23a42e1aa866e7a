"""TensorBoard event files of a run being resumed, checked record by record and cut back to their sound records.

An event file is a sequence of TFRecords: an 8-byte little-endian length, its masked CRC-32C, the data, the data's
masked CRC-32C. A kill mid-write leaves a torn last record; a disk error leaves bytes that fail a checksum. A
record whose length and header checksum hold but whose data fails its checksum is dropped alone (the records after
it are still framed); where the framing itself breaks, nothing after it can be found again, and the file ends
there. The CRC is tensorboard's own (pure Python, about 3 MB/s: the same cost the writer paid for those bytes)."""

from __future__ import annotations

import struct
from pathlib import Path

from spmd_rl.persist.fileio import write_atomic

_LENGTH = struct.Struct("<Q")
_CRC = struct.Struct("<I")


def sound_records(data: bytes) -> tuple[list[bytes], int, int]:
    """(the sound records, whole as written; how many framed records failed their data checksum; how many bytes at
    the end could not be framed)."""
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c  # imported where used: slow

    records, bad, position = [], 0, 0
    while position + 12 <= len(data):
        header = data[position : position + 8]
        if _CRC.unpack_from(data, position + 8)[0] != masked_crc32c(header):
            break
        length = _LENGTH.unpack(header)[0]
        end = position + 12 + length + 4
        if end > len(data):
            break
        body = data[position + 12 : end - 4]
        if _CRC.unpack_from(data, end - 4)[0] == masked_crc32c(body):
            records.append(data[position:end])
        else:
            bad += 1
        position = end
    return records, bad, len(data) - position


def repair_event_files(directory: Path, write: bool = True) -> str:
    """Rewrite every damaged event file in directory with its sound records only; what was dropped, for a note
    ('' when every file was sound). write=False: only the note, the files stay as they are."""
    dropped = []
    for path in sorted(directory.glob("events.out.tfevents.*")) if directory.is_dir() else []:
        data = path.read_bytes()
        records, bad, tail = sound_records(data)
        if not bad and not tail:
            continue
        if write:
            write_atomic(path, b"".join(records))
        parts = ([f"{bad} record(s) failing their checksum"] if bad else []) + (
            [f"{tail} unreadable byte(s) at the end"] if tail else []
        )
        dropped.append(f"{path}: dropped {' and '.join(parts)}, kept {len(records)} record(s)")
    return "; ".join(dropped)
