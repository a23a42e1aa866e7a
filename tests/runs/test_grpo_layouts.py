"""GRPO in every layout, each run by an algorithm that keeps every segment it learned from (tests/harness/
keeping_grpo.py: what learn receives stays valid after learn returns): colocated over 2 ranks, split over 5 ranks
with 2 FSDP trainers in bf16, and the async engine split over 4 ranks; the groups' outcomes reach every trainer."""

from __future__ import annotations

import pytest
from harness.runs import read_metrics, run_main

GRPO_TINY = [
    "env.id=Pendulum-v1",
    "algo.class=tests.harness.keeping_grpo:KeepingGRPO",
    "env.total_envs=8",
    "env.group_size=2",
    "env.action_chunk=2",
    "env.max_episode_steps=10",
    "algo.num_minibatches=2",
    "algo.filter_groups=true",
    "policy.hidden_sizes=[16]",
    "policy.temperature=1.6",
    "train.total_steps=320",  # 4 iterations of 5 decisions x 8 envs x 2 steps
    "dist.timeout_s=60",
    "log.progress=false",
    "log.tensorboard=false",
]

LAYOUTS = {
    "colocated2": (2, ["layout.mode=colocated"]),
    "split5-fsdp-bf16": (
        5,
        [
            "layout.mode=split",
            "layout.trainer=2",
            "layout.inference=1",
            "layout.env=2",
            "train.parallel=fsdp",
            "train.precision=bf16",
            "weights.verify_every=1",
        ],
    ),
    "async-split4": (
        4,
        [
            "layout.mode=split",
            "layout.trainer=1",
            "layout.inference=1",
            "layout.env=2",
            "engine.class=async",
            "engine.max_policy_lag=0",
        ],
    ),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_grpo_learns_in_every_layout_from_segments_it_may_keep(tmp_path, layout):
    nproc, args = LAYOUTS[layout]
    result = run_main(*GRPO_TINY, *args, f"run.dir={tmp_path}", nproc=nproc)
    assert result.returncode == 0, result.stderr[-3000:]
    records = read_metrics(tmp_path)
    assert [r["env_steps"] for r in records] == [80 * (i + 1) for i in range(4)]
    assert [r["segments_kept"] for r in records] == [1.0, 2.0, 3.0, 4.0]
    # Every env's episode (10 steps) ends in each rollout and reaches trainer 0's statistics.
    assert all(r["episodes"] == 8 * (i + 1) and r["episode_length_mean"] == 10.0 for i, r in enumerate(records))
    assert all(r["minibatch_steps"] > 0 and r["dropped_group_fraction"] == 0.0 for r in records)
