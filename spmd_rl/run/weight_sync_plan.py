"""Who sends the trainers' weights to the inference ranks of a split layout, and how: `WeightSyncPlan`, the one
place that decides it (from the parallel plan, the topology and inference.dtype) and builds each rank's part of a
sync. The builders ask it; the engines only call `publish_weights` / `take_weights` where `Plan.syncs_after` says.

The three ways, all received by a `WeightSync` on every inference rank, laid out alike:
- replicated trainers, the parameters' own dtype on the wire: trainer 0's parameters are the buckets
  (`WeightSync`, built before the optimizer and DDP, as it points the parameters into its flat buckets); the other
  trainers take no part;
- replicated trainers, another dtype on the wire (inference.dtype=bf16): every trainer casts one bucket at a time
  into a buffer of its own and trainer 0 broadcasts it (`GatheredWeightSource`, built after the algorithm);
- sharded trainers (train.parallel=fsdp): the senders of the parallel plan (one copy of the shards) each send their
  own rows straight to the inference ranks (`ShardedWeightSource`, after sharding), which receive them with the
  same senders.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import torch

from spmd_rl.comm.weight_sources import GatheredWeightSource, ShardedWeightSource
from spmd_rl.comm.weights import WeightSync
from spmd_rl.interfaces.policy import Policy

if TYPE_CHECKING:  # annotations only: the run hands itself to its builders
    from spmd_rl.run.run import Run

WIRE_DTYPES = {"fp32": None, "bf16": torch.bfloat16}  # inference.dtype: None = the parameters' own

# A member of the weight group that holds buckets, or a trainer's gathering source (or its sharded form).
SyncT = TypeVar("SyncT", WeightSync, GatheredWeightSource)


@dataclass(frozen=True)
class WeightSyncPlan:
    """A split layout's weight sync. `source`: trainer 0, whose version every sync carries (and which broadcasts
    unless shards travel); `senders`: the trainers that send their own shards, in shard order (none unless
    sharded); `receivers`: the inference ranks; `wire_dtype`: what travels (None: the parameters' own dtype);
    `gathered`: the trainers' tensors cannot be the buckets (sharded, or another wire dtype), so every trainer
    takes part, after its algorithm is built."""

    source: int
    senders: tuple[int, ...]
    receivers: tuple[int, ...]
    wire_dtype: torch.dtype | None
    gathered: bool

    @classmethod
    def of(cls, run: Run) -> WeightSyncPlan:
        parallel, wire = run.plan.parallel, run.cfg.inference.dtype
        return cls(
            source=run.topology.trainer_ranks[0],
            senders=parallel.sender_ranks,
            receivers=tuple(run.topology.inference_ranks),
            wire_dtype=WIRE_DTYPES[wire],
            gathered=parallel.sharded or wire != "fp32",
        )

    def trainer_member(self, run: Run, policy: Policy) -> WeightSync | GatheredWeightSource | None:
        """This trainer's part of every sync (None: it takes no part). When `gathered`, build it after the
        algorithm (the parameters are sharded by then); otherwise before (its buckets become the parameters)."""
        if self.senders:
            return self._member(
                run,
                policy,
                ShardedWeightSource,
                wire_dtype=self.wire_dtype,
                receivers=list(self.receivers),
                **self._sender_options(run),
            )
        if self.gathered:
            return self._member(run, policy, GatheredWeightSource, wire_dtype=self.wire_dtype)
        return self._member(run, policy, WeightSync) if run.rank == self.source else None

    def inference_member(self, run: Run, policy: Policy) -> WeightSync:
        """An inference rank's receiving end (its policy already in the wire dtype)."""
        return self._member(run, policy, WeightSync, **self._sender_options(run))

    def _sender_options(self, run: Run) -> dict:
        """With shards on the wire: who sends the pieces of every bucket, and the group they travel over."""
        if not self.senders:
            return {}
        return {"senders": list(self.senders), "sender_group": run.groups.weight_senders}

    def _member(self, run: Run, policy: Policy, kind: type[SyncT], **options) -> SyncT:
        return kind(
            policy,
            run.groups.weights,
            src=self.source,
            me=run.rank,
            bucket_bytes=int(run.cfg.weights.bucket_mb * 2**20),
            timeout=run.runtime.timeout,
            describe_rank=run.topology.describe,
            **options,
        )
