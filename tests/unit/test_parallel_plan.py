"""The parallel plan (spmd_rl/comm/parallel_plan.py): the one representation of how the trainers hold the policy,
checked once, and the only place that reads train.parallel's value."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from spmd_rl.comm.parallel_plan import ParallelPlan
from spmd_rl.config.sections import TrainSection
from spmd_rl.runtime.errors import UserError

PACKAGE = Path(__file__).resolve().parents[2] / "spmd_rl"


def plan(parallel: str, trainers, shard_group_size: int = 0, split: bool = True) -> ParallelPlan:
    train = TrainSection(parallel=parallel, shard_group_size=shard_group_size)
    return ParallelPlan.from_config(train, tuple(trainers), split)


def test_replicated_trainers_have_no_shard_groups_and_send_no_shards():
    replicas = plan("ddp", [2, 3])
    replicas.check()
    assert (replicas.sharded, replicas.shard_mesh, replicas.sender_ranks) == (False, None, ())


def test_sharded_trainers_of_a_split_layout_all_send_their_shards():
    sharded = plan("fsdp", [2, 3, 4, 5])
    sharded.check()
    assert (sharded.sharded, sharded.shard_mesh, sharded.sender_ranks) == (True, None, (2, 3, 4, 5))
    assert plan("fsdp", [0, 1], split=False).sender_ranks == ()  # colocated: nothing travels to other ranks


def test_hybrid_sharding_groups_consecutive_trainers_and_the_first_replica_sends():
    hybrid = plan("fsdp", [2, 3, 4, 5], shard_group_size=2)
    hybrid.check()
    assert hybrid.shard_mesh == [[2, 3], [4, 5]]
    assert hybrid.sender_ranks == (2, 3)


@pytest.mark.parametrize(
    ("parallel", "size", "words"),
    [("ddp", 2, "it needs train.parallel=fsdp"), ("fsdp", 3, "does not divide the 4 trainers")],
)
def test_a_shard_group_size_that_does_not_fit_is_one_line_naming_the_key(parallel, size, words):
    with pytest.raises(UserError, match=f"train.shard_group_size={size}.*{words}"):
        plan(parallel, [0, 1, 2, 3], shard_group_size=size).check()


def test_only_the_parallel_plan_reads_train_parallels_value():
    spelled = re.compile(r"""parallel\s*[!=]=\s*["']|["']fsdp["']\s*[!=]=""")
    readers = [
        str(path.relative_to(PACKAGE))
        for path in PACKAGE.rglob("*.py")
        if spelled.search(path.read_text()) and path.name != "parallel_plan.py"
    ]
    assert readers == []
