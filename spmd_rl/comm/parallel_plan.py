"""The parallel plan: how the trainers hold the policy, decided once from `train.parallel` and
`train.shard_group_size` and the trainer ranks, and checked then. Every place that asks whether the policy is
sharded, which trainers shard together, or which trainers send their shards to the inference ranks asks it (the
plan's `parallel`, the Context's `sharded`); only `shards` reads the setting's value. Free of torch, so the layout
is checked before any process group exists."""

from __future__ import annotations

from dataclasses import dataclass

from spmd_rl.runtime.errors import UserError

FSDP = "fsdp"  # train.parallel's value for a policy sharded over the trainers (FSDP2); "ddp": whole replicas


def shards(parallel: str) -> bool:
    """Whether train.parallel=`parallel` shards the policy over the trainers (rather than replicating it)."""
    return parallel == FSDP


@dataclass(frozen=True)
class ParallelPlan:
    """The trainers' layout of the policy. `trainers`: their global ranks, in order (every rank when colocated);
    `sharded`: FSDP2 over them (else DDP replicas); `shard_group_size`: hybrid sharding, shard within groups of
    this many consecutive trainers and replicate across the groups (0: one group of all); `split`: the inference
    ranks are others, so weights travel to them."""

    trainers: tuple[int, ...] = (0,)
    sharded: bool = False
    shard_group_size: int = 0
    split: bool = False

    @classmethod
    def from_config(cls, train, trainers: tuple[int, ...], split: bool) -> ParallelPlan:
        """From the train section (train.parallel, train.shard_group_size), unchecked (see `check`)."""
        return cls(tuple(trainers), shards(train.parallel), train.shard_group_size, split)

    def check(self) -> None:
        """A UserError naming train.shard_group_size when it does not fit train.parallel or the trainers."""
        size, count = self.shard_group_size, len(self.trainers)
        if size and not self.sharded:
            raise UserError(f"train.shard_group_size={size} is hybrid sharding: it needs train.parallel=fsdp")
        if size and count % size:
            raise UserError(
                f"train.shard_group_size={size} does not divide the {count} trainers; choose a divisor of "
                f"{count} (or 0 to shard over all of them)"
            )

    @property
    def shard_mesh(self) -> list[list[int]] | None:
        """With hybrid sharding, [replica][shard position] -> global rank; None otherwise."""
        size = self.shard_group_size
        if not size:
            return None
        return [list(self.trainers[i : i + size]) for i in range(0, len(self.trainers), size)]

    @property
    def sender_ranks(self) -> tuple[int, ...]:
        """The trainers that send their own shards to the inference ranks (one copy of the shards: all trainers,
        or the first replica's with hybrid sharding), in shard order; none unless sharded in a split layout."""
        if not (self.sharded and self.split):
            return ()
        return self.trainers[: self.shard_group_size] if self.shard_group_size else self.trainers
