"""Replay buffers: a ring of transitions sampled uniformly, in memory or in an HDF5 file, and sharded across trainers.

Both backends share the sampling (indices drawn here, from the caller's generator), so the same generator gives
the same batch whatever the backend. The HDF5 backend keeps only a staging buffer (at most ~4 MiB) and a table of
chunk addresses in memory, so its capacity is bounded by the disk, not by RAM; reopening its file restores contents
and cursor.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from tensordict import TensorDict

from spmd_rl.persist.checkpoint import MAPPED_ROWS
from spmd_rl.runtime.distributed import wait
from spmd_rl.runtime.errors import UserError
from spmd_rl.storage.schema import layout_of
from spmd_rl.storage.writer import DEFAULT_FLUSH_EVERY_S, HDF5Writer, check_rewind

BACKENDS = ("memory", "hdf5")

_NUMPY_TO_TORCH = {
    np.dtype(np.bool_): torch.bool,
    np.dtype(np.uint8): torch.uint8,
    np.dtype(np.int8): torch.int8,
    np.dtype(np.int16): torch.int16,
    np.dtype(np.int32): torch.int32,
    np.dtype(np.int64): torch.int64,
    np.dtype(np.float16): torch.float16,
    np.dtype(np.float32): torch.float32,
    np.dtype(np.float64): torch.float64,
}


def _nested(key: str) -> tuple[str, ...]:
    return tuple(key.split("/"))


class MemoryStorage:
    """Preallocated tensors, one row per transition."""

    def __init__(self, capacity: int, layout):
        self.capacity = capacity
        self.rows = TensorDict(
            {
                _nested(key): torch.empty((capacity, *shape), dtype=_NUMPY_TO_TORCH[dtype])
                for key, (shape, dtype) in layout.items()
            },
            batch_size=[capacity],
        )
        self._total = 0

    def __len__(self) -> int:
        return min(self._total, self.capacity)

    def add(self, rows: TensorDict) -> None:
        count = rows.batch_size[0]
        if count > self.capacity:  # only the newest `capacity` rows would survive anyway
            rows, self._total = rows[count - self.capacity :], self._total + count - self.capacity
            count = self.capacity
        positions = (self._total + torch.arange(count)) % self.capacity
        self.rows[positions] = rows
        self._total += count

    def read(self, indices: torch.Tensor) -> TensorDict:
        oldest = max(0, self._total - self.capacity)
        if oldest:  # the ring has wrapped: index 0 is the oldest row held, wherever it is
            indices = (oldest + indices) % self.capacity
        # Each tensor (or nested TensorDict) indexed by itself: the rows of self.rows[indices], without the
        # TensorDict's general indexing, which costs more than the copies for a batch of a few hundred rows.
        return TensorDict({key: value[indices] for key, value in self.rows.items()}, batch_size=[len(indices)])

    @property
    def total_rows(self) -> int:
        return self._total

    def rewind(self, total_rows: int) -> None:
        check_rewind("memory replay buffer", total_rows, self._total, self.capacity)
        self._total = total_rows

    def close(self) -> None:
        pass


class HDF5Storage:
    """A ring in an HDF5 file (see storage/writer.py): staged rows in memory, the rest read back on demand."""

    def __init__(
        self,
        capacity: int,
        layout,
        path: str | os.PathLike,
        chunk_rows: int | None,
        compression: str | None,
        flush_every_s: float,
    ):
        self.capacity = capacity
        self.writer = HDF5Writer(
            path, layout, chunk_rows=chunk_rows, compression=compression, capacity=capacity, flush_every_s=flush_every_s
        )

    def __len__(self) -> int:
        return len(self.writer)

    def add(self, rows: TensorDict) -> None:
        self.writer.append(rows)

    @property
    def total_rows(self) -> int:
        return self.writer.total_rows

    def rewind(self, total_rows: int) -> None:
        self.writer.rewind(total_rows)

    def read(self, indices: torch.Tensor) -> TensorDict:
        # read_rows sorts and deduplicates, so the file sees one increasing selection per key.
        arrays = self.writer.read_rows(indices.numpy())
        return TensorDict(
            {_nested(key): torch.from_numpy(array) for key, array in arrays.items()}, batch_size=[len(indices)]
        )

    def close(self) -> None:
        self.writer.close()


class ReplayBuffer:
    """A ring buffer of transitions (TensorDict rows: obs, action, reward, next_obs, terminated, ...).

    backend "memory" preallocates `capacity` rows; "hdf5" keeps them in the file at `path` (a reopened file
    continues where it stopped; rows staged in memory reach it within flush_every_s seconds of being added, see
    storage/writer.py). `add` takes a batch of rows (any batch dims, flattened); `sample` draws uniformly with
    replacement among the rows held.
    """

    def __init__(
        self,
        capacity: int,
        example_td: TensorDict,
        *,
        backend: str = "memory",
        path: str | os.PathLike | None = None,
        chunk_rows: int | None = None,
        compression: str | None = None,
        flush_every_s: float = DEFAULT_FLUSH_EVERY_S,
    ):
        if capacity < 1:
            raise UserError(f"buffer.capacity must be at least 1, got {capacity}")
        layout = layout_of(example_td)
        self.storage: MemoryStorage | HDF5Storage
        if backend == "memory":
            self.storage = MemoryStorage(capacity, layout)
        elif backend == "hdf5":
            if path is None:
                raise UserError("buffer.backend=hdf5 needs a file path for the replay buffer")
            self.storage = HDF5Storage(capacity, layout, path, chunk_rows, compression, flush_every_s)
        else:
            raise UserError(f"buffer.backend={backend!r} is not one of {BACKENDS}")
        self.capacity = capacity
        self.backend = backend

    def __len__(self) -> int:
        return len(self.storage)

    def add(self, td_batch: TensorDict) -> None:
        rows = td_batch.reshape(-1) if td_batch.batch_dims != 1 else td_batch
        self.storage.add(rows.cpu())

    def sample(self, batch_size: int, generator: torch.Generator | None = None) -> TensorDict:
        if len(self) == 0:
            raise ValueError("cannot sample from an empty replay buffer")
        return self.storage.read(torch.randint(len(self), (batch_size,), generator=generator))

    def read(self, indices: torch.Tensor) -> TensorDict:
        """The rows at these indices: 0 is the oldest row held, len(self) - 1 the newest."""
        return self.storage.read(indices)

    @property
    def total_rows(self) -> int:
        """Rows added over the buffer's life: the cursor a checkpoint saves."""
        return self.storage.total_rows

    def rewind(self, total_rows: int) -> None:
        """Forget the rows added after the first total_rows (resuming from a checkpoint that saved total_rows).

        Exact while no row held then has been overwritten since; otherwise a UserError. Only the hdf5 backend
        keeps its rows across a restart.
        """
        self.storage.rewind(total_rows)

    def state_dict(self) -> dict:
        """For a checkpoint: the cursor, and for the memory backend the rows themselves (the hdf5 backend's rows are
        in its file, which a resume rewinds to the cursor). The hdf5 backend's staged rows are written and committed
        first, so the cursor recorded is durable: a kill -9 right after the checkpoint leaves a file that holds it."""
        if isinstance(self.storage, HDF5Storage):
            self.storage.writer.flush()
        state: dict[str, Any] = {"total_rows": self.total_rows}
        if isinstance(self.storage, MemoryStorage):
            held = min(self.total_rows, self.capacity)
            # torch.save writes a view's whole storage, so the rows held alone need a copy. From half full on the
            # whole preallocated buffer is saved as it is instead: a copy would be another buffer in memory at
            # every checkpoint (a 100k-row Atari replay: 5.6 GB more; two such runs here were killed for it).
            # The file then holds at most twice the rows held; below half full the copy is at most half a buffer.
            whole = 2 * held >= self.capacity
            state[MAPPED_ROWS] = (self.storage.rows if whole else self.storage.rows[:held].clone()).to_dict()
            state["rows_saved"] = self.capacity if whole else held
        return state

    def load_state_dict(self, state: dict) -> None:
        if isinstance(self.storage, MemoryStorage):
            held = min(state["total_rows"], self.capacity)
            # "rows": a checkpoint written before its rows were read through mmap (they load copied, as then)
            rows = state[MAPPED_ROWS] if MAPPED_ROWS in state else state["rows"]
            saved = TensorDict(rows, batch_size=[state.get("rows_saved", held)])
            self.storage.rows[:held] = saved[:held]
            self.storage._total = state["total_rows"]
        else:
            self.rewind(state["total_rows"])

    def close(self) -> None:
        self.storage.close()


class Replay:
    """What `context.replay_buffer()` returns: this trainer's shard of the buffer (`add`, `len`, `close`) and
    `sample`, which draws a uniform global batch over all trainers' shards; one `state_dict` holds both the rows
    (or the file's cursor) and the sampler's generators, for a checkpoint."""

    def __init__(self, shard: ReplayBuffer):
        self.shard = shard

    def add(self, rows: TensorDict) -> None:
        """Append rows (transitions, batch_size [n]) to this trainer's shard."""
        self.shard.add(rows)

    def __len__(self) -> int:
        """Rows this trainer's shard holds."""
        return len(self.shard)

    def close(self) -> None:
        self.shard.close()

    def sample(self, batch_size: int) -> TensorDict:
        raise NotImplementedError

    def state_dict(self) -> dict:
        return {"shard": self.shard.state_dict(), "sampler": self._sampler_state()}

    def load_state_dict(self, state: dict) -> None:
        self.shard.load_state_dict(state["shard"])
        self._load_sampler_state(state["sampler"])

    def _sampler_state(self) -> dict:
        return {}

    def _load_sampler_state(self, state: dict) -> None:
        pass


class ShardedReplay(Replay):
    """Uniform sampling over the union of the trainers' shards, each trainer holding (and reading) only its own.

    To sample a global batch of B rows, the trainers all_gather their shard sizes n_1..n_T and split B among the
    shards in proportion to their sizes: trainer i takes c_i rows, uniformly with replacement from its own shard,
    where c_i is B * n_i / N (N = n_1 + ... + n_T) rounded down or up by systematic sampling with one uniform
    number that every trainer draws alike from a generator seeded the same on all of them. So the c_i always add
    up to B, E[c_i] = B * n_i / N exactly, and every row of every shard expects B / N draws per batch: uniform
    over the union, with less variance than B independent draws. No rows move between ranks.

    With shards of equal size, every trainer gets B / T rows (when T divides B), so averaging per-trainer mean
    losses over the group (as DDP does) weights every row 1 / B. With unequal shards it does not: weight the
    local loss as per_row_loss.sum() * T / B to keep the global batch's mean.
    """

    def __init__(self, shard: ReplayBuffer, group: dist.ProcessGroup | None, timeout: datetime.timedelta, seed: int):
        super().__init__(shard)
        self.group = group
        self.timeout = timeout
        self.ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        self.index = self.ranks.index(dist.get_rank())
        self.shared = torch.Generator().manual_seed(seed)  # same stream on every trainer: the split of B
        self.local = torch.Generator().manual_seed(seed + 1 + self.index)  # this trainer's rows

    def shard_sizes(self) -> torch.Tensor:
        """The size of every trainer's shard, in group order (a bounded all_gather)."""
        mine = torch.tensor([len(self.shard)], dtype=torch.int64)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in self.ranks]
        work = dist.all_gather(sizes, mine, group=self.group, async_op=True)
        wait(
            work,
            self.timeout,
            lambda: (
                f"rank {dist.get_rank()} (trainer): all_gather of replay shard sizes with trainer ranks {self.ranks}"
            ),
        )
        return torch.cat(sizes)

    def split(self, global_batch_size: int, sizes: torch.Tensor) -> torch.Tensor:
        """Rows each shard contributes to a global batch (see the class docstring); draws from `shared`."""
        total = int(sizes.sum())
        if total == 0:
            raise ValueError("cannot sample: every replay shard is empty")
        edges = torch.cumsum(sizes, 0).double() * global_batch_size / total
        offset = torch.rand((), dtype=torch.float64, generator=self.shared)
        bounds = torch.floor(torch.cat([torch.zeros(1, dtype=torch.float64), edges]) + offset).long()
        bounds[-1] = global_batch_size  # edges[-1] is B exactly; guard against its rounding
        return bounds.diff()

    def sample(self, global_batch_size: int) -> TensorDict:
        """This trainer's part of a uniform global batch of global_batch_size rows."""
        counts = self.split(global_batch_size, self.shard_sizes())
        # An empty shard always gets 0 rows; randint still needs a non-empty range to draw those 0 from.
        indices = torch.randint(max(len(self.shard), 1), (int(counts[self.index]),), generator=self.local)
        return self.shard.read(indices)

    def _sampler_state(self) -> dict:
        return {"shared": self.shared.get_state(), "local": self.local.get_state()}

    def _load_sampler_state(self, state: dict) -> None:
        self.shared.set_state(state["shared"])
        self.local.set_state(state["local"])


class LocalReplay(Replay):
    """A single trainer's replay: its shard is the whole buffer."""

    def sample(self, batch_size: int) -> TensorDict:
        return self.shard.sample(batch_size)  # draws from torch's global generator, which checkpoints save
