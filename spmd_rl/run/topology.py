"""Which rank plays which role: a pure function of (layout, world size), validated before any group exists.

Split layouts number ranks by role: trainers first (so global rank 0 is trainer 0, the rank that logs and
broadcasts weights), then inference ranks, then env ranks. Env ranks are dealt round-robin to inference ranks and
to trainer ranks, which balances both to within one.

The colocated layout has every rank play every role: its own envs, its own policy copy, DDP across all ranks.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

from spmd_rl.comm.parallel_plan import ParallelPlan
from spmd_rl.config.sections import LayoutSection
from spmd_rl.runtime.errors import UserError

TRAINER, INFERENCE, ENV, COLOCATED = "trainer", "inference", "env", "colocated"


@dataclass(frozen=True)
class Topology:
    mode: str
    world_size: int
    trainer_ranks: tuple[int, ...]
    inference_ranks: tuple[int, ...]
    env_ranks: tuple[int, ...]
    env_to_inference: dict[int, int]  # env rank -> the inference rank that serves it
    env_to_trainer: dict[int, int]  # env rank -> the trainer rank that learns from it

    @property
    def colocated(self) -> bool:
        return self.mode == COLOCATED

    def role_of(self, rank: int) -> str:
        if self.colocated:
            return COLOCATED
        for role, ranks in ((TRAINER, self.trainer_ranks), (INFERENCE, self.inference_ranks), (ENV, self.env_ranks)):
            if rank in ranks:
                return role
        raise ValueError(f"rank {rank} is outside the world of {self.world_size}")

    def index_of(self, rank: int) -> int:
        """The rank's index within its role (its colocated rank in the colocated layout)."""
        if self.colocated:
            return rank
        return {TRAINER: self.trainer_ranks, INFERENCE: self.inference_ranks, ENV: self.env_ranks}[
            self.role_of(rank)
        ].index(rank)

    def describe(self, rank: int) -> str:
        """'rank 5 (env 1)': how messages name a rank."""
        return f"rank {rank} ({self.role_of(rank)} {self.index_of(rank)})"

    @property
    def weight_ranks(self) -> tuple[int, ...]:
        """Trainer rank 0 and every inference rank: the group weights are broadcast over."""
        return () if self.colocated else (self.trainer_ranks[0],) + self.inference_ranks

    def uses_gpu(self, rank: int) -> bool:
        """Whether the rank runs the policy or learns (a GPU's work); env ranks only step envs, on the CPU."""
        return self.role_of(rank) != ENV

    def gpu_slot(self, rank: int, local_rank: int, local_world_size: int) -> tuple[int | None, int]:
        """(this rank's index among its node's GPU-using ranks, or None for an env rank; how many its node has).
        Launchers number a node's ranks contiguously, so its ranks are rank - local_rank ... + local_world_size."""
        first = rank - local_rank
        users = [r for r in range(first, first + local_world_size) if self.uses_gpu(r)]
        return (users.index(rank) if rank in users else None), len(users)

    def envs_served_by(self, inference_rank: int) -> tuple[int, ...]:
        return tuple(e for e in self.env_ranks if self.env_to_inference[e] == inference_rank)

    def envs_trained_by(self, trainer_rank: int) -> tuple[int, ...]:
        return tuple(e for e in self.env_ranks if self.env_to_trainer[e] == trainer_rank)


def build_topology(layout: LayoutSection, world_size: int) -> Topology:
    if world_size < 1:
        raise UserError(f"world size {world_size} is impossible")
    if layout.mode == COLOCATED:
        set_counts = [f"layout.{k}={getattr(layout, k)}" for k in (TRAINER, INFERENCE, ENV) if getattr(layout, k)]
        if set_counts:
            raise UserError(
                f"{', '.join(set_counts)} only applies to layout.mode=split; remove it or set layout.mode=split"
            )
        ranks = tuple(range(world_size))
        identity = {r: r for r in ranks}
        return Topology(COLOCATED, world_size, ranks, ranks, ranks, identity, dict(identity))

    counts = {TRAINER: layout.trainer, INFERENCE: layout.inference, ENV: layout.env}
    rest = [k for k, v in counts.items() if v == -1]
    if len(rest) > 1:
        raise UserError(
            f"layout: only one of layout.trainer, layout.inference, layout.env may be -1 (the rest); "
            f"got -1 for {', '.join('layout.' + k for k in rest)}"
        )
    if rest:
        counts[rest[0]] = world_size - sum(v for k, v in counts.items() if k != rest[0])
    described = f"trainer={counts[TRAINER]}, inference={counts[INFERENCE]}, env={counts[ENV]}"
    if world_size < 3:  # one rank of each role at the least: counts cannot fix it
        raise UserError(
            f"layout.mode=split needs at least 3 ranks (a trainer, an inference and an env rank), and this run has "
            f"{world_size}: start more ranks (torchrun --nproc_per_node, mpirun -n) or set layout.mode=colocated"
        )
    if sum(counts.values()) != world_size or any(v < 0 for v in counts.values()):
        raise UserError(
            f"layout {described} needs {sum(v for v in counts.values() if v > 0)} ranks but the world "
            f"size is {world_size}; make the counts sum to {world_size} (or set one of them to -1)"
        )
    for role in (TRAINER, INFERENCE, ENV):
        if counts[role] == 0:
            raise UserError(
                f"layout {described}: a split layout needs at least one {role} rank; set layout.{role} >= 1"
            )
    if counts[INFERENCE] > counts[ENV]:
        raise UserError(
            f"layout {described}: more inference ranks than env ranks leaves an inference rank "
            f"with nothing to serve; set layout.inference <= layout.env"
        )
    if counts[TRAINER] > counts[ENV]:
        raise UserError(
            f"layout {described}: more trainer ranks than env ranks leaves a trainer with no data; "
            f"set layout.trainer <= layout.env"
        )

    trainers = tuple(range(counts[TRAINER]))
    inference = tuple(range(len(trainers), len(trainers) + counts[INFERENCE]))
    envs = tuple(range(len(trainers) + len(inference), world_size))
    return Topology(
        mode="split",
        world_size=world_size,
        trainer_ranks=trainers,
        inference_ranks=inference,
        env_ranks=envs,
        env_to_inference={e: inference[i % len(inference)] for i, e in enumerate(envs)},
        env_to_trainer={e: trainers[i % len(trainers)] for i, e in enumerate(envs)},
    )


@dataclass
class ProcessGroups:
    """The groups a rank uses: the trainer group (the world when colocated; None in one process), the weight
    group (split layouts only) and, with hybrid sharding (train.shard_group_size), this trainer's shard group and
    replicate group. Roles only use the groups they are members of."""

    trainer: object | None
    weights: object | None
    shard: object | None = None  # the trainers this one shards the policy with
    replicate: object | None = None  # the trainers holding the same shards as this one (one per shard group)
    shard_mesh: list[list[int]] | None = None  # [replica][shard position] -> global rank
    # train.parallel=fsdp in a split layout: the group of the trainers that send their own shards
    # (ParallelPlan.sender_ranks) and the inference ranks, which their sends go over.
    weight_senders: object | None = None


def create_process_groups(topology: Topology, timeout: datetime.timedelta, parallel: ParallelPlan) -> ProcessGroups:
    """Every rank creates every group, once, in this order (new_group is collective over the world): the parallel
    plan's shard and replicate groups, and the group the sharded trainers of a split layout send over."""
    import torch.distributed as dist  # here: main.py checks the layout before torch is imported

    if not dist.is_initialized():
        return ProcessGroups(trainer=None, weights=None)
    if topology.colocated:
        groups = ProcessGroups(trainer=dist.group.WORLD, weights=None)
    else:
        trainer = dist.new_group(list(topology.trainer_ranks), timeout=timeout)
        weights = dist.new_group(list(topology.weight_ranks), timeout=timeout)
        groups = ProcessGroups(trainer=trainer, weights=weights)
    mesh = parallel.shard_mesh
    if mesh:
        me = dist.get_rank()
        for ranks in mesh:  # shard groups, then replicate groups: the same order on every rank
            group = dist.new_group(ranks, timeout=timeout)
            if me in ranks:
                groups.shard = group
        for column in zip(*mesh):
            group = dist.new_group(list(column), timeout=timeout)
            if me in column:
                groups.replicate = group
        groups.shard_mesh = mesh
    if parallel.sender_ranks:
        groups.weight_senders = dist.new_group(
            sorted(parallel.sender_ranks + topology.inference_ranks), timeout=timeout
        )
    return groups
