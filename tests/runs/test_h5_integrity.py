"""Checksummed HDF5 rows (issue 19, item 2), each defect reproduced the way it was found.

- 4 KB of overwritten row data in a file written by a real run: `data inspect`, the reader, the replay buffer and a
  resume (PPO's experience log, SAC's HDF5 replay buffer) exit 2 with one line naming the file and the rows;
- damaged HDF5 metadata: randomized bytes (64 files) are a one-line UserError naming the file or read back as
  written, each within seconds; a damaged chunk index makes a resume exit 2 naming the file (the replay buffer's
  first sample hung in HDF5's SWMR retries before: "error in user code" or no end at all);
- a damaged cursor that still looks possible is caught by its own checksum;
- files written before the checksums (no fletcher32 filter) are still read, appended to and inspected.
"""

import random
import shutil
import subprocess
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from harness.launch import PYTHON, ROOT
from harness.runs import SAC_RESUME_TINY as SAC_TINY
from harness.runs import TINY, assert_one_line_exit_2
from harness.runs import run_main_measured as run_main
from tensordict import TensorDict

from spmd_rl import experience
from spmd_rl.runtime.errors import UserError
from spmd_rl.storage.reader import HDF5Reader
from spmd_rl.storage.replay import ReplayBuffer
from spmd_rl.storage.writer import HDF5Writer

PPO_LOG = ("--config", TINY, "buffer.log_experience=true")
SAC_HDF5 = (*SAC_TINY, "buffer.backend=hdf5")
SEEDS = 64  # files with randomized metadata


def rows(count: int, first: int = 0) -> TensorDict:
    ids = torch.arange(first, first + count)
    return TensorDict({"id": ids, "obs": ids[:, None].float().expand(count, 3).clone()}, batch_size=[count])


def overwrite_row_data(path, dataset: str, chunk: int = 0, nbytes: int = 4096, seed: int = 0) -> None:
    """Overwrite nbytes of a dataset's chunk (its row data, from the chunk's start) with random bytes."""
    with h5py.File(path, "r") as file:
        info = file[dataset].id.get_chunk_info(chunk)
    assert info.size >= nbytes
    with open(path, "r+b") as raw:
        raw.seek(info.byte_offset)
        old = raw.read(nbytes)
        new = random.Random(seed).randbytes(nbytes)
        assert new != old
        raw.seek(info.byte_offset)
        raw.write(new)


def damage_metadata(path, seed: int, nbytes: int) -> None:
    """Randomize nbytes bytes of the file outside its chunks' row data: superblock, object headers, chunk indexes,
    attributes (as found: randomized metadata)."""
    spans = []
    with h5py.File(path, "r") as file:

        def visit(_, item):
            if isinstance(item, h5py.Dataset) and item.chunks:
                for index in range(item.id.get_num_chunks()):
                    info = item.id.get_chunk_info(index)
                    spans.append((info.byte_offset, info.byte_offset + info.size))

        file.visititems(visit)
    content = bytearray(path.read_bytes())
    rng = random.Random(seed)
    changed = 0
    while changed < nbytes:
        at = rng.randrange(len(content))
        if not any(low <= at < high for low, high in spans):
            content[at] = (content[at] + rng.randrange(1, 256)) % 256
            changed += 1
    path.write_bytes(content)


def test_overwritten_rows_are_named_by_the_reader_inspect_and_the_replay_buffer(tmp_path, capsys):
    path = tmp_path / "replay.h5"
    replay = ReplayBuffer(256, rows(1), backend="hdf5", path=path, chunk_rows=64)
    replay.add(rows(200))
    replay.close()
    overwrite_row_data(path, "data/obs", chunk=1, nbytes=256)  # rows 64..127 (768 bytes a chunk)
    damaged_rows = rf"{path} is damaged: rows 64\.\.127 of /data/obs fail HDF5's checks"
    with HDF5Reader(path) as reader:
        np.testing.assert_array_equal(reader.read(0, 64)["id"], np.arange(64))  # other chunks read as before
        with pytest.raises(UserError, match=damaged_rows):
            reader.read(0, 200)
        with pytest.raises(UserError, match=damaged_rows):
            reader.check_rows()
    assert experience.main(["inspect", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {path} is damaged: rows 64..127 of /data/obs"), err
    assert err[0].endswith("restore the file from a copy"), err
    # The replay buffer reads sampled rows directly, past HDF5's checks: it verifies the file before its first read.
    replay = ReplayBuffer(256, rows(1), backend="hdf5", path=path)
    with pytest.raises(UserError, match=damaged_rows):
        replay.sample(8, generator=torch.Generator().manual_seed(0))
    with pytest.raises(UserError, match="closed after a failed write or damage found"):
        replay.sample(8)
    replay = ReplayBuffer(256, rows(1), backend="hdf5", path=path)
    with pytest.raises(UserError, match=damaged_rows):
        replay.rewind(100)  # a resume: the rows the checkpoint names are verified
    replay = ReplayBuffer(256, rows(1), backend="hdf5", path=path)
    replay.rewind(64)  # rows 0..63 are sound: a resume to them drops the damaged chunk
    assert len(replay) == 64
    replay.add(rows(10, 64))
    np.testing.assert_array_equal(replay.read(torch.arange(74))["id"].numpy(), np.arange(74))
    replay.close()


def test_a_damaged_ring_and_a_damaged_cursor_are_found(tmp_path):
    path = tmp_path / "ring.h5"
    with HDF5Writer(path, rows(1), chunk_rows=8, capacity=32) as writer:
        writer.append(rows(50))  # rows 18..49 held, at positions 18..31 and 0..17
    overwrite_row_data(path, "meta/env_step", chunk=1, nbytes=16)  # positions 8..15: rows 40..47
    with HDF5Reader(path) as reader:
        with pytest.raises(UserError, match=rf"{path} is damaged: rows 8\.\.15 of /meta/env_step"):
            reader.check_rows()
    writer = HDF5Writer(path, rows(1), capacity=32, flush_every_s=0)
    # a writer's advice: removing the file alone is refused next when a checkpoint counts rows in it (pass 4, I7d)
    continuing = (
        rf"{path} is damaged: rows 8\.\.15 of /meta/env_step .*; restore it from a copy, or remove it and the "
        r"run's checkpoints/ to start over$"
    )
    with pytest.raises(UserError, match=continuing):
        writer.append(rows(1))  # a write verifies the file first
    with pytest.raises(UserError, match="closed after a failed write or damage found"):
        writer.append(rows(1))
    path = tmp_path / "sound.h5"
    with HDF5Writer(path, rows(1), chunk_rows=8, capacity=32) as writer:
        writer.append(rows(20))
    with h5py.File(path, "r+") as file:  # a cursor that still looks possible: only its checksum tells
        info = file["cursor"].id.get_chunk_info(0)
    with open(path, "r+b") as raw:
        raw.seek(info.byte_offset)
        raw.write(np.array([60, 60], dtype=np.int64).tobytes())
    for open_it in (HDF5Reader, lambda p: HDF5Writer(p, rows(1), capacity=32)):
        with pytest.raises(UserError, match=rf"{path} is damaged: .*; restore it or remove it"):
            open_it(path)


def test_a_damaged_chunk_across_the_cursor_is_named_or_dropped_by_a_rewind_before_it(tmp_path):
    """A crash between a chunk write and its cursor update leaves rows past the cursor; their chunk, damaged, also
    holds committed rows. Opening the file shrank the datasets to the cursor, which rewrites that chunk: HDF5 failed
    with "Unable to ... change a dataset's dimensions" and no rows named, even where the resume's rewind would have
    dropped the chunk."""

    def crashed_file() -> Path:
        path = tmp_path / "log.h5"
        path.unlink(missing_ok=True)
        with HDF5Writer(path, rows(1), chunk_rows=64) as writer:
            writer.append(rows(192))
        with h5py.File(path, "r+") as file:
            file["cursor"][:] = 150  # rows 150..191 were written, the cursor not yet moved over them
        overwrite_row_data(path, "data/obs", chunk=2, nbytes=256)  # rows 128..191
        return path

    for use in (lambda writer: writer.rewind(140), lambda writer: writer.append(rows(1, 150))):
        writer = HDF5Writer(crashed_file(), rows(1), chunk_rows=64, flush_every_s=0)
        with pytest.raises(UserError, match=r"log\.h5 is damaged: rows 128\.\.149 of /data/obs"):
            use(writer)
    # A checkpoint before the damaged chunk: the rewind drops it, and the file goes on from there.
    with HDF5Writer(crashed_file(), rows(1), chunk_rows=64) as writer:
        writer.rewind(100)
        writer.append(rows(10, 100))
    with HDF5Reader(tmp_path / "log.h5") as reader:
        assert reader.check_rows() and reader.read()["id"].tolist() == list(range(110))


def test_an_undamaged_file_reads_as_before_and_says_it_was_verified(tmp_path, capsys):
    path = tmp_path / "log.h5"
    with HDF5Writer(path, rows(1), chunk_rows=16, flush_every_s=0) as writer:
        for first in range(0, 100, 7):  # partial chunks, rewritten whole as they fill
            writer.append(rows(7, first), env_step=np.arange(first, first + 7))
    with h5py.File(path, "r") as file:
        assert all(file[name].fletcher32 for name in ("data/id", "data/obs", "meta/env_step", "cursor"))
    with HDF5Reader(path) as reader:
        np.testing.assert_array_equal(reader.read(0, 105)["id"], np.arange(105))
        assert reader.check_rows()
    assert experience.main(["inspect", str(path)]) == 0
    assert "checksums: every row verified (fletcher32)" in capsys.readouterr().out


def test_a_file_written_before_checksums_is_still_read_and_continued(tmp_path, capsys):
    path, old = tmp_path / "new.h5", tmp_path / "old.h5"
    with HDF5Writer(path, rows(1), chunk_rows=16) as writer:
        writer.append(rows(40))
    with h5py.File(path, "r") as new, h5py.File(old, "w", libver="latest") as file:
        file.attrs.update(new.attrs)
        for name in ("data/id", "data/obs", "meta/policy_version", "meta/env_id", "meta/env_step"):
            source = new[name]
            file.create_dataset(name, data=source[:], chunks=source.chunks, maxshape=source.maxshape)
        file.create_dataset("cursor", data=new["cursor"][:])  # contiguous, as before
    with HDF5Writer(old, rows(1)) as writer:
        writer.rewind(40)
        writer.append(rows(10, 40))
    with HDF5Reader(old) as reader:
        np.testing.assert_array_equal(reader.read()["id"], np.arange(50))
        assert not reader.check_rows()
    assert experience.main(["inspect", str(old)]) == 0
    assert "checksums: none (a file written before spmd_rl checksummed its rows): not verified" in (
        capsys.readouterr().out
    )


def inspect_run(run_dir):
    return subprocess.run(
        [PYTHON, "-m", "spmd_rl.experience", "inspect", str(run_dir)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, name", [(PPO_LOG, "experience_rank0.h5"), (SAC_HDF5, "replay_rank0.h5")], ids=["ppo_log", "sac_hdf5"]
)
def test_overwritten_rows_of_a_run_make_inspect_and_resume_exit_2_naming_file_and_rows(tmp_path, args, name):
    # As found: 4 KB of overwritten row data were read back silently.
    run_dir = tmp_path / "run"
    first, _, _ = run_main(*args, f"run.dir={run_dir}")
    assert first.returncode == 0, first.stderr[-3000:]
    (run_dir / "finished.json").unlink()  # as if it had stopped after its last checkpoint
    path = run_dir / "buffer" / name
    overwrite_row_data(path, "data/obs")
    inspected = inspect_run(run_dir)
    lines = inspected.stderr.strip().splitlines()
    assert inspected.returncode == 2 and len(lines) == 1, inspected.stderr
    assert lines[0].startswith(f"error: {path} is damaged: rows 0..") and "of /data/obs" in lines[0], lines
    result, _, _ = run_main(*args, f"run.dir={run_dir}")
    assert_one_line_exit_2(result, f"{path} is damaged: rows 0..", "of /data/obs fail HDF5's checks")


def test_randomized_metadata_is_a_user_error_naming_the_file_or_reads_as_written(tmp_path):
    # As found: randomized metadata gave exit 4 ("error in user code") with no file name; a damaged chunk index made
    # the replay buffer's first sample hang (a SWMR writer retries a failed metadata read for hours).
    source = tmp_path / "source.h5"
    replay = ReplayBuffer(1000, rows(1), backend="hdf5", path=source, chunk_rows=64)
    replay.add(rows(600))
    replay.close()
    outcomes = []
    for seed in range(SEEDS):
        path = tmp_path / f"damaged{seed}.h5"
        shutil.copy(source, path)
        damage_metadata(path, seed, nbytes=2)
        started = time.monotonic()
        try:
            replay = ReplayBuffer(1000, rows(1), backend="hdf5", path=path)
            replay.rewind(600)
            np.testing.assert_array_equal(replay.read(torch.arange(600))["id"].numpy(), np.arange(600))
            replay.add(rows(100, 600))
            replay.close()
            with HDF5Reader(path) as reader:
                np.testing.assert_array_equal(reader.read()["id"], np.arange(700))
            outcomes.append("read as written")
        except UserError as exc:
            assert str(exc).startswith(str(path)) and "\n" not in str(exc), exc
            outcomes.append("user error")
        assert time.monotonic() - started < 10, seed
    assert outcomes.count("user error") >= SEEDS // 4, outcomes


@pytest.mark.slow
def test_a_damaged_chunk_index_makes_resume_exit_2_naming_the_file(tmp_path):
    # The replay file's fixed-array data block (its chunks' addresses), damaged: the resume hung at the first sample.
    args = (*SAC_HDF5, "buffer.chunk_rows=16")
    run_dir = tmp_path / "run"
    first, _, _ = run_main(*args, f"run.dir={run_dir}")
    assert first.returncode == 0, first.stderr[-3000:]
    (run_dir / "finished.json").unlink()
    path = run_dir / "buffer" / "replay_rank0.h5"
    content = bytearray(path.read_bytes())
    at = content.find(b"FADB")
    assert at > 0
    content[at + 20] ^= 0xFF
    path.write_bytes(content)
    result, elapsed, _ = run_main(*args, f"run.dir={run_dir}")
    assert_one_line_exit_2(result, f"{path} is damaged")


def test_a_wrapped_ring_read_that_fails_once_is_read_again_through_a_fresh_handle(tmp_path, monkeypatch):
    # A live reader can catch a chunk while the writer rewrites it: the retry reopens the file, so the ring's second
    # part must be read through the new handle (it was read through the closed one: a TypeError traceback).
    path = tmp_path / "ring.h5"
    writer = HDF5Writer(path, rows(1), chunk_rows=4, capacity=16, overwrite=True, flush_every_s=0)
    writer.append(rows(20))
    writer.close()
    read = h5py.Dataset.__getitem__
    failures = iter([OSError("Can't read data (filter returned failure during read)")])

    def once_mid_rewrite(dataset, selection):
        failure = next(failures, None)
        if failure is not None:
            raise failure
        return read(dataset, selection)

    with HDF5Reader(path) as reader:
        monkeypatch.setattr(h5py.Dataset, "__getitem__", once_mid_rewrite)
        assert reader.column("data/id").tolist() == list(range(4, 20))
