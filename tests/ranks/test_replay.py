"""Replay buffer: both backends, ring eviction, uniform sampling, reopening, sharded sampling on real gloo ranks."""

import datetime
import gc
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from harness.multiproc import assert_all_ok, run_ranks
from tensordict import TensorDict

from spmd_rl.persist.checkpoint import MAPPED_ROWS, CheckpointStore, load_checkpoint
from spmd_rl.runtime.errors import UserError
from spmd_rl.storage.replay import ReplayBuffer, ShardedReplay


def transitions(ids) -> TensorDict:
    """Transitions whose every key encodes the row id, so a misplaced or torn row shows."""
    ids = torch.as_tensor(ids, dtype=torch.int64)
    return TensorDict(
        {
            "id": ids,
            "obs": ids[:, None].float().expand(-1, 3).clone(),
            "action": (ids % 7).to(torch.int32),
            "reward": ids.double() / 2,
            "next": {"obs": ids[:, None].float().expand(-1, 3) + 1, "terminated": ids % 5 == 0},
        },
        batch_size=[len(ids)],
    )


def assert_consistent(batch: TensorDict) -> None:
    ids = batch["id"]
    torch.testing.assert_close(batch["obs"], ids[:, None].float().expand(-1, 3))
    torch.testing.assert_close(batch["next", "obs"], ids[:, None].float().expand(-1, 3) + 1)
    assert torch.equal(batch["action"], (ids % 7).to(torch.int32))
    assert torch.equal(batch["reward"], ids.double() / 2)
    assert torch.equal(batch["next", "terminated"], ids % 5 == 0)


def make_buffer(backend: str, capacity: int, tmp_path, chunk_rows: int = 16) -> ReplayBuffer:
    """backend "hdf5-lzf": compressed chunks, which are read through HDF5 instead of by direct row reads."""
    compression = "lzf" if backend == "hdf5-lzf" else None
    return ReplayBuffer(
        capacity,
        transitions([0]),
        backend=backend.removesuffix("-lzf"),
        path=tmp_path / "replay_rank0.h5",
        chunk_rows=chunk_rows,
        compression=compression,
    )


@pytest.mark.parametrize("backend", ["memory", "hdf5", "hdf5-lzf"])
def test_ring_keeps_the_newest_rows(backend, tmp_path):
    buffer = make_buffer(backend, 100, tmp_path)
    for start in range(0, 250, 25):  # [5, 5]-shaped batches are flattened to rows
        buffer.add(transitions(range(start, start + 25)).reshape(5, 5))
    assert len(buffer) == 100
    held = buffer.read(torch.arange(100))
    assert_consistent(held)
    assert held["id"].tolist() == list(range(150, 250))  # the newest 100, oldest first
    buffer.add(transitions(range(1000, 1250)))  # a batch larger than the ring: only its newest rows stay
    assert buffer.read(torch.arange(100))["id"].tolist() == list(range(1150, 1250))
    buffer.close()


def test_backends_sample_the_same_rows_for_the_same_generator(tmp_path):
    memory, hdf5 = make_buffer("memory", 64, tmp_path), make_buffer("hdf5", 64, tmp_path)
    for buffer in (memory, hdf5):
        buffer.add(transitions(range(90)))
    batches = [buffer.sample(256, torch.Generator().manual_seed(3)) for buffer in (memory, hdf5)]
    assert_consistent(batches[1])
    assert torch.equal(batches[0]["id"], batches[1]["id"])
    hdf5.close()


@pytest.mark.parametrize("backend", ["memory", "hdf5", "hdf5-lzf"])
def test_sampling_is_uniform(backend, tmp_path):
    rows, draws = 50, 256 * 80
    buffer = make_buffer(backend, rows, tmp_path)
    buffer.add(transitions(range(rows)))
    generator = torch.Generator().manual_seed(0)
    counts = torch.zeros(rows)
    for _ in range(draws // 256):
        batch = buffer.sample(256, generator)
        assert_consistent(batch)
        counts += torch.bincount(batch["id"], minlength=rows)
    expected = draws / rows
    chi_square = float(((counts - expected) ** 2 / expected).sum())
    # 49 degrees of freedom: mean 49, P(chi2 > 100) ~ 2e-5. A bias toward some rows (say, staged or in-file rows
    # drawn twice as often) gives thousands.
    assert chi_square < 100, (chi_square, counts)
    buffer.close()


def test_hdf5_samples_rows_not_yet_written_to_the_file(tmp_path):
    buffer = make_buffer("hdf5", 1000, tmp_path, chunk_rows=64)
    buffer.add(transitions(range(70)))  # a whole chunk goes to the file, 6 rows are staged in memory
    for start in range(70, 300, 10):  # small adds: staged, several chunks' worth, before one bigger write
        buffer.add(transitions(range(start, start + 10)))
    writer = buffer.storage.writer
    assert 0 < writer.stored_rows_committed < 300
    batch = buffer.sample(3000, torch.Generator().manual_seed(1))
    assert_consistent(batch)
    assert set(batch["id"].tolist()) == set(range(300))
    buffer.close()


def test_hdf5_reopen_restores_contents_and_cursor(tmp_path):
    buffer = make_buffer("hdf5", 100, tmp_path)
    buffer.add(transitions(range(130)))
    buffer.close()
    buffer = make_buffer("hdf5", 100, tmp_path)
    assert len(buffer) == 100
    assert sorted(buffer.read(torch.arange(100))["id"].tolist()) == list(range(30, 130))
    buffer.add(transitions(range(130, 140)))  # the cursor was restored: the 10 oldest rows go
    held = buffer.read(torch.arange(100))
    assert_consistent(held)
    assert sorted(held["id"].tolist()) == list(range(40, 140))
    buffer.close()


@pytest.mark.parametrize("backend", ["memory", "hdf5"])
def test_rewind_to_a_checkpointed_cursor(backend, tmp_path):
    buffer = make_buffer(backend, 200, tmp_path)
    buffer.add(transitions(range(100)))
    checkpoint = buffer.total_rows
    buffer.add(transitions(range(1000, 1033)))  # added after the checkpoint, then the run died
    if backend == "hdf5":
        buffer.close()
        buffer = make_buffer(backend, 200, tmp_path)
    buffer.rewind(checkpoint)
    assert len(buffer) == 100 and buffer.total_rows == 100
    buffer.add(transitions(range(100, 150)))
    held = buffer.read(torch.arange(150))
    assert_consistent(held)
    assert held["id"].tolist() == list(range(150))
    buffer.add(transitions(range(150, 260)))  # wraps: rows 0..59 are overwritten
    with pytest.raises(UserError, match="10 of the rows held then have been overwritten"):
        buffer.rewind(250)
    buffer.close()


def test_bad_buffer_settings_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="not one of"):
        ReplayBuffer(10, transitions([0]), backend="disk")
    with pytest.raises(UserError, match="needs a file path"):
        ReplayBuffer(10, transitions([0]), backend="hdf5")
    with pytest.raises(UserError, match="capacity must be at least 1"):
        ReplayBuffer(0, transitions([0]))


SHARD_SIZES = (10, 30, 60)


def _sharded_sampling(rank: int, world_size: int, directory: str) -> None:
    backend = "hdf5" if rank == 1 else "memory"  # the helper does not care how a shard is stored
    shard = ReplayBuffer(100, transitions([0]), backend=backend, path=f"{directory}/replay_rank{rank}.h5", chunk_rows=8)
    shard.add(transitions(rank * 1000 + torch.arange(SHARD_SIZES[rank])))
    sharded = ShardedReplay(shard, None, datetime.timedelta(seconds=30), seed=123)
    assert sharded.shard_sizes().tolist() == list(SHARD_SIZES)
    per_row = torch.zeros(sum(SHARD_SIZES))
    for _ in range(40):
        batch = sharded.sample(500)
        assert_consistent(batch)
        ids = batch["id"]
        assert ((ids >= rank * 1000) & (ids < rank * 1000 + SHARD_SIZES[rank])).all()  # own shard only
        per_row += torch.bincount(sum(SHARD_SIZES[:rank]) + ids - rank * 1000, minlength=len(per_row))
        assert len(ids) == 500 * SHARD_SIZES[rank] // sum(SHARD_SIZES)  # proportional shares are whole here
    dist.all_reduce(per_row)
    if rank == 0:
        # Uniform over the union of all rows (not over shards): every row expects 40 * 500 / 100 = 200 draws.
        expected = 40 * 500 / sum(SHARD_SIZES)
        chi_square = float(((per_row - expected) ** 2 / expected).sum())
        assert per_row.min() > 0 and chi_square < 180, (chi_square, per_row)  # 99 dof: P(> 180) ~ 1e-6
    shard.close()


def test_sharded_sampling_is_uniform_over_all_shards(tmp_path):
    assert_all_ok(run_ranks(_sharded_sampling, 3, str(tmp_path), timeout_s=30))


def _split_of_the_global_batch(rank: int, world_size: int) -> None:
    shard = ReplayBuffer(100, transitions([0]))
    shard.add(transitions(torch.arange(7 + 3 * rank)))  # shard sizes 7, 10, 13: shares are not whole
    sharded = ShardedReplay(shard, None, datetime.timedelta(seconds=30), seed=5)
    sizes = sharded.shard_sizes()
    expected = 256 * sizes.double() / sizes.sum()
    counts = torch.stack([sharded.split(256, sizes) for _ in range(4000)])
    assert (counts.sum(1) == 256).all()  # always exactly the global batch
    assert ((counts == expected.floor()) | (counts == expected.ceil())).all()  # each share rounded down or up
    torch.testing.assert_close(counts.double().mean(0), expected, atol=0.03, rtol=0)  # unbiased on average
    mine = sharded.sample(256)
    everyone = [torch.zeros(1, dtype=torch.int64) for _ in range(world_size)]
    dist.all_gather(everyone, torch.tensor([len(mine)]))
    assert sum(int(n) for n in everyone) == 256  # all trainers drew the same split


def test_sharded_split_adds_up_and_is_unbiased():
    assert_all_ok(run_ranks(_split_of_the_global_batch, 3, timeout_s=30))


def test_a_memory_checkpoint_holds_only_the_rows_added_not_the_capacity(tmp_path):
    buffer = make_buffer("memory", 100_000, tmp_path)
    buffer.add(transitions(range(10)))
    path = tmp_path / "state.pt"
    torch.save(buffer.state_dict(), path)
    assert path.stat().st_size < 20_000  # the capacity's 100,000 rows would be megabytes
    restored = make_buffer("memory", 100_000, tmp_path)
    restored.load_state_dict(torch.load(path, weights_only=True))
    assert len(restored) == 10 and torch.equal(restored.storage.rows[:10]["id"], torch.arange(10))


@pytest.mark.parametrize("added", [50, 99, 100, 250])
def test_a_memory_checkpoint_from_half_full_on_saves_the_buffer_itself_without_a_copy(tmp_path, added):
    """A copy of a large replay at every checkpoint doubled its memory (a 100k-row Atari replay: 5.6 GB more, and
    the run was killed for it); from half full the state holds the buffer's own tensors, and the file loads back
    through mmap (as checkpoints load) to the same rows, wrapped or not."""
    buffer = make_buffer("memory", 100, tmp_path)
    buffer.add(transitions(range(added)))
    state = buffer.state_dict()
    assert state[MAPPED_ROWS]["obs"].data_ptr() == buffer.storage.rows["obs"].data_ptr()
    path = tmp_path / "state.pt"
    torch.save(state, path)
    restored = make_buffer("memory", 100, tmp_path)
    restored.load_state_dict(torch.load(path, weights_only=True, mmap=True))
    assert len(restored) == len(buffer) == min(added, 100) and restored.total_rows == added
    assert torch.equal(restored.read(torch.arange(len(buffer)))["id"], buffer.read(torch.arange(len(buffer)))["id"])
    assert (restored.storage.rows == buffer.storage.rows)[: len(buffer)].all()


def _mapped(file: Path) -> bool:
    return any(str(file) in line for line in Path("/proc/self/maps").read_text().splitlines())


def test_a_resume_keeps_no_mapping_of_the_checkpoint_file_once_the_rows_are_copied_in(tmp_path):
    """Checkpoints load through mmap, and only a replay's rows stay backed by the file while the replay copies them
    into its own buffer. A tensor kept as loaded (Adam keeps its moments' tensors) would keep the whole file mapped,
    and its disk space in use after the checkpoint is pruned, until the process ends."""
    net = torch.nn.Linear(64, 64)
    adam = torch.optim.Adam(net.parameters())
    net(torch.randn(8, 64)).sum().backward()
    adam.step()
    buffer = make_buffer("memory", 100, tmp_path)
    buffer.add(transitions(range(80)))  # from half full the rows go to the file as they are
    store = CheckpointStore(tmp_path, keep=1)
    store.save({"optimizer": adam.state_dict(), "replay": buffer.state_dict()}, 1, 0)
    file = store.commit(1, world_size=1) / "rank0.pt"

    state = load_checkpoint(file.parent, rank=0)
    assert _mapped(file)  # the rows, read as the replay copies them
    resumed = torch.optim.Adam(net.parameters())
    resumed.load_state_dict(state["optimizer"])
    restored = make_buffer("memory", 100, tmp_path)
    restored.load_state_dict(state["replay"])
    del state
    gc.collect()
    assert not _mapped(file)
    store.save({"optimizer": resumed.state_dict()}, 2, 0)
    store.commit(2, world_size=1)  # keep=1: the first checkpoint is pruned, and its space is free
    assert not file.exists() and not _mapped(file)
    assert torch.equal(resumed.state_dict()["state"][0]["exp_avg"], adam.state_dict()["state"][0]["exp_avg"])
    assert torch.equal(restored.read(torch.arange(80))["id"], torch.arange(80))
