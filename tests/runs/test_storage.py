"""HDF5 experience storage: round trips, ring mode, reopening, kill -9, a live reader, bad files, `inspect`."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import h5py
import numpy as np
import pytest
import torch
from tensordict import TensorDict

from spmd_rl import experience
from spmd_rl.runtime.errors import UserError
from spmd_rl.storage.experience_log import ExperienceLog
from spmd_rl.storage.reader import HDF5Reader
from spmd_rl.storage.writer import HDF5Writer

PYTHON = sys.executable


def every_dtype_rows(rows: int, seed: int = 0) -> TensorDict:
    g = torch.Generator().manual_seed(seed)
    return TensorDict(
        {
            "obs": torch.randn(rows, 3, generator=g),
            "value": torch.randn(rows, 2, 2, generator=g, dtype=torch.float64),
            "action": torch.randint(-5, 5, (rows,), generator=g, dtype=torch.int32),
            "ids": torch.randint(-(2**40), 2**40, (rows, 5), generator=g, dtype=torch.int64),
            "pixels": torch.randint(0, 256, (rows, 4, 4), generator=g, dtype=torch.uint8),
            "next": {"terminated": torch.rand(rows, generator=g) < 0.3},
        },
        batch_size=[rows],
    )


def id_rows(ids) -> TensorDict:
    """Rows whose every key encodes the row id, so a torn or misplaced row shows."""
    ids = torch.as_tensor(ids, dtype=torch.int64)
    return TensorDict({"id": ids, "obs": ids[:, None].float().expand(-1, 4).clone()}, batch_size=[len(ids)])


def assert_rows_equal(arrays: dict, expected: TensorDict) -> None:
    for key, value in expected.items(include_nested=True, leaves_only=True):
        path = "/".join(key) if isinstance(key, tuple) else key
        np.testing.assert_array_equal(arrays[path], value.numpy(), err_msg=path)
        assert arrays[path].dtype == value.numpy().dtype, path


@pytest.mark.parametrize("compression", [None, "lzf"])
def test_round_trip_every_dtype_and_shape(tmp_path, compression):
    rows = every_dtype_rows(2500)
    path = tmp_path / "rank0.h5"
    with HDF5Writer(path, rows[:1], chunk_rows=512, compression=compression) as writer:
        start = 0
        for size in (1, 700, 1500, 299):  # partial chunks, several whole chunks, a tail
            writer.append(rows[start : start + size], policy_version=start)
            start += size
    with HDF5Reader(path) as reader:
        assert len(reader) == 2500
        assert_rows_equal(reader.read(), rows)
        assert reader.read_tensordict()["next", "terminated"].dtype == torch.bool
    # Plain h5py reads the same rows without spmd_rl.
    with h5py.File(path, "r") as file:
        np.testing.assert_array_equal(file["data/pixels"][:], rows["pixels"].numpy())
        np.testing.assert_array_equal(file["data/next/terminated"][:], rows["next", "terminated"].numpy())
        assert file["meta/policy_version"][700] == 1 and file["meta/policy_version"][701] == 701
        assert file["cursor"][0] == 2500


def test_experience_log_flattens_rollouts_with_metadata(tmp_path):
    T, N = 5, 3
    rollout = id_rows(torch.arange(T * N)).reshape(T, N)
    log = ExperienceLog(tmp_path, rank=1, example_td=rollout)
    log.append(rollout, policy_version=7, env_step=100)
    log.append(rollout, policy_version=8, env_step=115)
    log.close()
    with HDF5Reader(tmp_path / "buffer" / "experience_rank1.h5") as reader:
        arrays = reader.read(meta=True)
    np.testing.assert_array_equal(arrays["id"], np.tile(np.arange(T * N), 2))  # time-major rows
    np.testing.assert_array_equal(arrays["meta/env_id"], np.tile(np.arange(N), 2 * T))
    np.testing.assert_array_equal(arrays["meta/env_step"], np.arange(100, 130))
    np.testing.assert_array_equal(arrays["meta/policy_version"], [7] * 15 + [8] * 15)


def test_ring_wraps_and_reads_staged_rows(tmp_path):
    path = tmp_path / "ring.h5"
    writer = HDF5Writer(path, id_rows([0]), chunk_rows=4, capacity=10)
    for start, size in ((0, 3), (3, 9), (12, 11)):  # 23 rows: wraps twice, 3 rows left staged
        writer.append(id_rows(range(start, start + size)))
    assert len(writer) == 10 and writer.total_rows == 23 and writer.first_row == 13
    # Index 0 is the oldest row held (13); rows 20..22 are still only in the staging buffer.
    arrays = writer.read_rows(np.array([9, 0, 1, 2, 3, 4, 5, 6, 7, 8, 0]))
    np.testing.assert_array_equal(arrays["id"], [22, 13, 14, 15, 16, 17, 18, 19, 20, 21, 13])
    np.testing.assert_array_equal(arrays["obs"][:, 0], arrays["id"].astype(np.float32))
    writer.close()
    with HDF5Reader(path) as reader:
        assert len(reader) == 10 and reader.total_rows == 23
        np.testing.assert_array_equal(reader.read()["id"], np.arange(13, 23))
        np.testing.assert_array_equal(reader.read(2, 5)["id"], [15, 16, 17])
    with h5py.File(path, "r") as file:  # plain h5py: row r at position r % capacity
        np.testing.assert_array_equal(file["data/id"][:], [20, 21, 22, 13, 14, 15, 16, 17, 18, 19])


def test_reopen_continues_after_the_last_row(tmp_path):
    path = tmp_path / "log.h5"
    with HDF5Writer(path, id_rows([0]), chunk_rows=8) as writer:
        writer.append(id_rows(range(5)))
    with HDF5Writer(path, id_rows([0])) as writer:  # chunk_rows not given: the file's is kept
        assert len(writer) == 5 and writer.chunk_rows == 8
        writer.append(id_rows(range(5, 12)))
    with HDF5Reader(path) as reader:
        np.testing.assert_array_equal(reader.read()["id"], np.arange(12))
    with HDF5Writer(path, id_rows([0])) as writer:  # resuming from a checkpoint taken at row 9
        writer.rewind(9)
        writer.append(id_rows(range(100, 103)))
    with HDF5Reader(path) as reader:
        np.testing.assert_array_equal(reader.read()["id"], list(range(9)) + [100, 101, 102])


def test_wrong_schema_names_file_key_and_difference(tmp_path):
    path = tmp_path / "log.h5"
    HDF5Writer(path, id_rows([0]), chunk_rows=8).close()
    other = {"id": ((), "int64"), "obs": ((5,), "float32")}
    with pytest.raises(UserError, match=r"log\.h5: key 'obs' is float32\[4\] in the file but float32\[5\]"):
        HDF5Writer(path, other, chunk_rows=8)
    with pytest.raises(UserError, match=r"key 'extra' of the new layout is not in the file"):
        HDF5Writer(path, {"id": ((), "int64"), "obs": ((4,), "float32"), "extra": ((), "bool")}, chunk_rows=8)
    with pytest.raises(UserError, match=r"capacity is 0 in the file but 100"):
        HDF5Writer(path, id_rows([0]), chunk_rows=8, capacity=100)
    # The refused opens left the file usable.
    HDF5Writer(path, id_rows([0]), chunk_rows=8).close()


def test_corrupt_foreign_and_doubly_opened_files_are_user_errors(tmp_path):
    corrupt = tmp_path / "corrupt.h5"
    corrupt.write_bytes(b"not an hdf5 file" * 100)
    with pytest.raises(UserError, match="corrupt.h5 is not a readable HDF5 file"):
        HDF5Reader(corrupt)
    with pytest.raises(UserError, match="corrupt.h5 is not a readable HDF5 file"):
        HDF5Writer(corrupt, id_rows([0]))
    foreign = tmp_path / "foreign.h5"
    with h5py.File(foreign, "w") as file:
        file["x"] = np.arange(3)
    with pytest.raises(UserError, match="not an spmd_rl experience file"):
        HDF5Reader(foreign)
    with HDF5Writer(tmp_path / "live.h5", id_rows([0])):
        with pytest.raises(UserError, match="already open for writing"):
            HDF5Writer(tmp_path / "live.h5", id_rows([0]))
    with pytest.raises(UserError, match="compression 'gzip' is not supported"):
        HDF5Writer(tmp_path / "gz.h5", id_rows([0]), compression="gzip")


def test_rows_that_do_not_fit_the_layout_are_user_errors(tmp_path):
    with HDF5Writer(tmp_path / "log.h5", id_rows([0]), chunk_rows=8) as writer:
        rows = id_rows(range(3))
        with pytest.raises(UserError, match=r"key 'obs': rows are float64\[3, 4\]"):
            writer.append(rows.apply(lambda value: value.double() if value.is_floating_point() else value))
        with pytest.raises(UserError, match=r"missing keys \['obs'\]"):
            writer.append(rows.exclude("obs"))
        with pytest.raises(UserError, match="env_step must be one value or one per row"):
            writer.append(rows, env_step=[1, 2])
        writer.append(rows, env_step=[1, 2, 3])
        assert len(writer) == 3


WRITER_SCRIPT = textwrap.dedent("""
    import sys, torch
    from tensordict import TensorDict
    from spmd_rl.storage.writer import HDF5Writer
    writer = HDF5Writer(sys.argv[1], {"id": ((), "int64"), "obs": ((4,), "float32")}, chunk_rows=64)
    row = 0
    while True:  # until killed: every append is one whole chunk, so it is written and committed at once
        ids = torch.arange(row, row + 64)
        writer.append(TensorDict({"id": ids, "obs": ids[:, None].float().expand(-1, 4)}, batch_size=[64]))
        row += 64
        print(row, flush=True)
""")


def test_kill_9_mid_append_keeps_every_flushed_row(tmp_path):
    path = tmp_path / "crash.h5"
    child = subprocess.Popen([PYTHON, "-c", WRITER_SCRIPT, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        committed = 0
        deadline = time.monotonic() + 60
        while committed < 64 * 50 and time.monotonic() < deadline:
            committed = int(child.stdout.readline() or 0) or committed
        assert committed >= 64 * 50, "the writer did not get going"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(10)
    assert child.returncode == -signal.SIGKILL
    with HDF5Reader(path) as reader:
        arrays = reader.read()
    rows = len(arrays["id"])
    assert rows >= committed and rows % 64 == 0
    np.testing.assert_array_equal(arrays["id"], np.arange(rows))
    np.testing.assert_array_equal(arrays["obs"], np.repeat(np.arange(rows, dtype=np.float32)[:, None], 4, 1))
    # A new writer takes over the crashed file (clearing HDF5's open-for-write flags) and continues it.
    with HDF5Writer(path, id_rows([0]), chunk_rows=64) as writer:
        assert len(writer) == rows
        writer.append(id_rows(range(rows, rows + 10)))
    with h5py.File(path, "r") as file:  # closed cleanly again: plain h5py opens it
        np.testing.assert_array_equal(file["data/id"][:], np.arange(rows + 10))


TORN_WRITE_SCRIPT = textwrap.dedent("""
    import os, sys, h5py, torch
    from tensordict import TensorDict
    from spmd_rl.storage.writer import HDF5Writer

    def rows(first, stop):
        ids = torch.arange(first, stop)
        return TensorDict({"id": ids, "obs": ids[:, None].float().expand(-1, 4)}, batch_size=[stop - first])

    writer = HDF5Writer(sys.argv[1], {"id": ((), "int64"), "obs": ((4,), "float32")}, chunk_rows=8, capacity=32)
    writer.append(rows(0, 40))  # the ring wrapped: rows 8..39 are held
    write = h5py.Dataset.__setitem__

    def die_before_obs(dataset, selection, value):  # the process dies between two keys of one write
        if dataset.name == "/data/obs":
            os._exit(9)
        write(dataset, selection, value)

    h5py.Dataset.__setitem__ = die_before_obs
    writer.append(rows(40, 48))  # overwrites rows 8..15: "id" gets the new rows, "obs" keeps the old ones
""")


def test_a_ring_write_cut_short_leaves_no_torn_rows(tmp_path):
    path = tmp_path / "ring.h5"
    result = subprocess.run([PYTHON, "-c", TORN_WRITE_SCRIPT, str(path)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 9, result.stderr
    with HDF5Reader(path) as reader:
        arrays = reader.read()
    # Rows 8..15 were being overwritten: out of the valid range, not half old and half new.
    np.testing.assert_array_equal(arrays["id"], np.arange(16, 40))
    np.testing.assert_array_equal(arrays["obs"], np.repeat(np.arange(16, 40, dtype=np.float32)[:, None], 4, 1))
    with HDF5Writer(path, id_rows([0]), chunk_rows=8, capacity=32) as writer:
        assert len(writer) == 24
        writer.append(id_rows(range(40, 48)))
        assert len(writer) == 32
        held = writer.read_rows(np.arange(32))
    np.testing.assert_array_equal(held["id"], np.arange(16, 48))
    np.testing.assert_array_equal(held["obs"][:, 0], np.arange(16, 48, dtype=np.float32))


READER_SCRIPT = textwrap.dedent("""
    import sys, time
    import numpy as np
    from spmd_rl.storage.reader import HDF5Reader
    reader = HDF5Reader(sys.argv[1])
    print(len(reader), flush=True)
    deadline = time.monotonic() + 30
    while reader.refresh() < 400 and time.monotonic() < deadline:
        time.sleep(0.01)
    ids = reader.read()["id"]
    np.testing.assert_array_equal(ids, np.arange(len(ids)))
    print(len(ids), flush=True)
""")


def test_a_reader_in_another_process_sees_new_rows(tmp_path):
    path = tmp_path / "live.h5"
    with HDF5Writer(path, id_rows([0]), chunk_rows=64) as writer:
        writer.append(id_rows(range(100)))
        writer.flush()
        reader = subprocess.Popen([PYTHON, "-c", READER_SCRIPT, str(path)], stdout=subprocess.PIPE, text=True)
        try:
            assert reader.stdout.readline().strip() == "100"
            writer.append(id_rows(range(100, 400)))
            writer.flush()
            out, _ = reader.communicate(timeout=60)
        finally:
            reader.kill()
            reader.wait()
    assert reader.returncode == 0 and out.strip() == "400"


def test_inspect_summarizes_a_run(tmp_path, capsys):
    rollout = every_dtype_rows(60).reshape(20, 3)
    log = ExperienceLog(tmp_path, 0, rollout, chunk_rows=16)
    log.append(rollout[:10], policy_version=3, env_step=0)
    log.append(rollout[10:], policy_version=5, env_step=30)
    log.close()
    assert experience.main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    terminated = int(rollout["next", "terminated"].sum())
    assert "experience_rank0.h5  (60 rows, 60 appended" in out
    assert "pixels" in out and "uint8[4, 4]" in out and "value" in out and "float64[2, 2]" in out
    assert "policy versions: 3..5" in out
    assert f"episodes ended: {terminated} (rows with next/terminated set)" in out


def test_inspect_bad_input_exits_2_with_one_line(tmp_path, capsys):
    (tmp_path / "buffer").mkdir()
    (tmp_path / "buffer" / "rank0.h5").write_bytes(b"\x00garbage" * 64)
    result = subprocess.run(
        [PYTHON, "-m", "spmd_rl.experience", "inspect", str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"error: {tmp_path / 'buffer' / 'rank0.h5'} is not a readable HDF5 file: "
    ), lines
    for target in (tmp_path / "missing", tmp_path / "buffer" / "rank0.h5"):
        assert experience.main(["inspect", str(target)]) == 2
        assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_the_deprecated_data_module_still_inspects_and_says_what_replaces_it(tmp_path):
    rollout = every_dtype_rows(6).reshape(2, 3)
    log = ExperienceLog(tmp_path, 0, rollout, chunk_rows=16)
    log.append(rollout, policy_version=0, env_step=0)
    log.close()
    runs = {
        module: subprocess.run(
            [PYTHON, "-m", module, "inspect", str(tmp_path)], capture_output=True, text=True, timeout=120
        )
        for module in ("spmd_rl.data", "spmd_rl.experience")
    }
    assert runs["spmd_rl.data"].returncode == runs["spmd_rl.experience"].returncode == 0
    assert runs["spmd_rl.data"].stdout == runs["spmd_rl.experience"].stdout
    assert "use python -m spmd_rl.experience" in runs["spmd_rl.data"].stderr


def test_staged_rows_are_written_once_the_oldest_has_waited_flush_every_s(tmp_path):
    with HDF5Writer(tmp_path / "bounded.h5", id_rows([0]), chunk_rows=64, flush_every_s=0.2) as writer:
        writer.append(id_rows([0]))
        assert writer.stored_rows_committed == 0  # a partial chunk waits in memory...
        time.sleep(0.25)
        writer.append(id_rows([1]))
        assert writer.stored_rows_committed == 2  # ...until the oldest staged row is flush_every_s old
        writer.append(id_rows([2]))
        assert writer.stored_rows_committed == 2
    with HDF5Writer(tmp_path / "every.h5", id_rows([0]), chunk_rows=64, flush_every_s=0) as writer:
        for row in range(3):
            writer.append(id_rows([row]))
            assert writer.stored_rows_committed == row + 1
    with HDF5Writer(tmp_path / "whole.h5", id_rows([0]), chunk_rows=64, flush_every_s=float("inf")) as writer:
        writer.append(id_rows(range(10)))
        time.sleep(0.01)
        writer.append(id_rows(range(10, 20)))
        assert writer.stored_rows_committed == 0  # whole stages (or a flush) only
    with HDF5Reader(tmp_path / "whole.h5") as reader:  # close flushed
        np.testing.assert_array_equal(reader.read()["id"], np.arange(20))
    with pytest.raises(UserError, match="buffer.flush_every_s must be >= 0"):
        HDF5Writer(tmp_path / "negative.h5", id_rows([0]), flush_every_s=-1.0)


def test_replay_and_experience_log_pass_flush_every_s_on(tmp_path):
    from spmd_rl.storage.replay import ReplayBuffer

    replay = ReplayBuffer(
        100, id_rows([0]), backend="hdf5", path=tmp_path / "replay.h5", chunk_rows=16, flush_every_s=0
    )
    replay.add(id_rows(range(5)))
    assert replay.storage.writer.stored_rows_committed == 5
    replay.close()
    log = ExperienceLog(tmp_path, 0, id_rows([0]), chunk_rows=16, flush_every_s=0)
    log.append(id_rows(range(5)), policy_version=0, env_step=0)
    assert log._writer.stored_rows_committed == 5
    log.close()


def test_inspect_answers_at_once_on_a_truncated_or_corrupt_file(tmp_path):
    # A SWMR reader skips HDF5's end-of-file check and retries failed metadata reads for hours: this hung before.
    whole = tmp_path / "whole.h5"
    with HDF5Writer(whole, id_rows([0]), chunk_rows=64) as writer:
        writer.append(id_rows(range(20_000)))
    truncated, corrupt = tmp_path / "truncated.h5", tmp_path / "corrupt.h5"
    content = whole.read_bytes()
    truncated.write_bytes(content)
    os.truncate(truncated, len(content) // 2)
    corrupt.write_bytes(content[:48] + b"\xab" * 64 + content[112:])  # the root group's header, after the superblock
    for path, problem in ((truncated, "is truncated: "), (corrupt, "is damaged: ")):
        result = subprocess.run(
            [PYTHON, "-m", "spmd_rl.experience", "inspect", str(path)], capture_output=True, text=True, timeout=120
        )
        assert result.returncode == 2, result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"error: {path} {problem}"), lines
