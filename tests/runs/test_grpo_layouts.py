"""GRPO in every layout, each run by an algorithm that keeps every segment it learned from (tests/harness/
keeping_grpo.py: what learn receives stays valid after learn returns): colocated over 2 ranks, split over 5 ranks
with 2 FSDP trainers in bf16, and the async engine split over 4 ranks; the groups' outcomes reach every trainer.
With the KL to the reference policy, 2 FSDP trainers build the policy once (trainer 1 takes it on the meta device:
its reference is values of its own shards) and resume exactly, and a checkpoint of theirs resumes on one trainer."""

from __future__ import annotations

import json

import pytest
from harness.runs import assert_same_run, read_metrics, run_main

from spmd_rl.persist.run_files import FINISHED

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


FSDP_KL = [
    *(arg for arg in GRPO_TINY if not arg.startswith("algo.class=")),
    "algo.class=grpo",
    "algo.kl_coef=0.1",
    "train.parallel=fsdp",
]
SPLIT5 = ["layout.mode=split", "layout.trainer=2", "layout.inference=1", "layout.env=2"]


def test_fsdp_trainers_with_a_kl_take_the_policy_on_meta_and_resume_exactly(tmp_path):
    full = run_main(*FSDP_KL, *SPLIT5, f"run.dir={tmp_path / 'full'}", nproc=5)
    assert full.returncode == 0, full.stderr[-3000:]
    ranks = json.loads((tmp_path / "full" / FINISHED).read_text())["ranks"]
    assert [r["policy_builds"] for r in ranks if r["role"] == "trainer"] == [1, 0], ranks
    assert all(r["kl_ref"] > 0 for r in read_metrics(tmp_path / "full"))

    stopped = run_main(*FSDP_KL, *SPLIT5, f"run.dir={tmp_path / 'halves'}", "run.stop_after_iterations=2", nproc=5)
    assert "stopped by run.stop_after_iterations=2" in stopped.stdout + stopped.stderr, stopped.stderr[-3000:]
    resumed = run_main(*FSDP_KL, *SPLIT5, f"run.dir={tmp_path / 'halves'}", nproc=5)
    assert resumed.returncode == 0 and "resuming from" in resumed.stdout, resumed.stderr[-3000:]
    assert_same_run(tmp_path / "full", tmp_path / "halves")


def test_the_reference_of_two_fsdp_trainers_resumes_on_one(tmp_path):
    # The reference's shards are read back laid out over one trainer, as the model's and Adam's are.
    run_main(*FSDP_KL, "layout.mode=colocated", f"run.dir={tmp_path}", "run.stop_after_iterations=2", nproc=2)
    one = run_main(*FSDP_KL, "layout.mode=colocated", f"run.dir={tmp_path}")
    assert one.returncode == 0, one.stderr[-3000:]
    assert "was saved by 2 rank(s) (colocated), this run has 1" in one.stdout
    assert [r["iteration"] for r in read_metrics(tmp_path)] == [0, 1, 2, 3]
