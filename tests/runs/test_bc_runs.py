"""bc end to end: `algo.class=bc` on a scripted expert's demonstrations (harness/demos.py) learns with no rollouts,
reports eval_success_rate, shares the episodes over two colocated trainers (ddp, resuming exactly; fsdp); PPO and
GRPO start from its run with run.init_from; a missing demos path and demonstrations of another env are one line and
exit 2."""

from __future__ import annotations

import pytest
import torch
from harness.demos import ReachExpert, collect
from harness.runs import assert_one_line_exit_2, assert_same_run, read_metrics, run_main

ENV = ["env.id=tests.harness.vla_fixtures:InstructedReach-v0", "env.action_chunk=2"]
POLICY = [
    "policy.hidden_sizes=[32]",
    "policy.cnn_channels=[4]",
    "policy.cnn_kernels=[3]",
    "policy.cnn_strides=[2]",
    "policy.cnn_features=16",
]
QUIET = ["log.progress=false", "log.tensorboard=false"]


def bc_args(demos, run_dir, *extra, evaluation=("eval.every=3", "eval.episodes=4")):
    return [
        *ENV, *POLICY, *QUIET, "env.num_envs=1", "algo.class=bc", f"algo.demos={demos}", "algo.iterations=6",
        "algo.batch_size=32", "algo.learning_rate=0.003", *evaluation, f"run.dir={run_dir}", *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def demos(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("demos")
    collect(run_dir, [*ENV, "env.num_envs=4", "algo.num_steps=10"], ReachExpert, rollouts=2)
    return run_dir


@pytest.fixture(scope="module")
def bc_run(demos, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("bc") / "run"
    result = run_main(*bc_args(demos, run_dir))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "6 iterations, no env steps (no rollouts)" in result.stdout
    return run_dir


def test_bc_learns_without_rollouts_and_evaluates_success(bc_run):
    records = read_metrics(bc_run)
    assert [record["env_steps"] for record in records] == [0] * 6
    assert records[-1]["nll_loss"] < records[0]["nll_loss"]
    assert (records[0]["demo_episodes"], records[0]["demo_decisions"], records[0]["demo_cut_chunks"]) == (16, 64, 0)
    assert [("eval_success_rate" in record) for record in records] == [False, False, True] * 2
    assert (bc_run / "policy.pt").exists() and (bc_run / "checkpoints").is_dir()


def test_two_trainers_share_the_episodes_and_resume_exactly(demos, tmp_path):
    full = run_main(*bc_args(demos, tmp_path / "full"), nproc=2)
    assert full.returncode == 0, full.stderr[-3000:]
    last = read_metrics(tmp_path / "full")[-1]
    assert (last["demo_episodes"], last["demo_decisions"], last["minibatch_steps"]) == (16, 64, 2)
    stopped = run_main(*bc_args(demos, tmp_path / "split", "run.stop_after_iterations=3"), nproc=2)
    assert stopped.returncode == 75, stopped.stderr[-3000:]
    resumed = run_main(*bc_args(demos, tmp_path / "split"), nproc=2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_run(tmp_path / "full", tmp_path / "split")


def test_two_trainers_shard_the_policy_with_fsdp(demos, tmp_path):
    # Evaluation is refused with fsdp (rank 0 would act alone with a sharded policy).
    result = run_main(*bc_args(demos, tmp_path / "fsdp", "train.parallel=fsdp", evaluation=()), nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(read_metrics(tmp_path / "fsdp")) == 6 and (tmp_path / "fsdp" / "policy.pt").exists()


def test_ppo_starts_from_the_bc_run(bc_run, tmp_path):
    # With a learning rate of 0, PPO's weights stay the ones it started from: bc's, value head included.
    result = run_main(
        *ENV, *POLICY, *QUIET, f"run.init_from={bc_run}", "algo.learning_rate=0", "algo.num_steps=4",
        "env.num_envs=2", "train.total_steps=16", f"run.dir={tmp_path / 'ppo'}",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    bc, ppo = torch.load(bc_run / "policy.pt"), torch.load(tmp_path / "ppo" / "policy.pt")
    assert bc.keys() == ppo.keys() and all(torch.equal(bc[key], ppo[key]) for key in bc)


def test_grpo_starts_from_the_bc_run(bc_run, tmp_path):
    result = run_main(
        *ENV, *POLICY, *QUIET, f"run.init_from={bc_run}", "algo.class=grpo", "env.num_envs=4", "env.group_size=2",
        "env.max_episode_steps=8", "train.total_steps=64", f"run.dir={tmp_path / 'grpo'}",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "success_rate" in read_metrics(tmp_path / "grpo")[-1]


def test_missing_demonstrations_are_one_line_and_exit_2(tmp_path):
    result = run_main(*bc_args(tmp_path / "nowhere", tmp_path / "run"))
    assert_one_line_exit_2(result, "algo.demos=", "nowhere: no such file or folder")


def test_demonstrations_of_another_env_are_one_line_and_exit_2(demos, tmp_path):
    result = run_main(*bc_args(demos, tmp_path / "run", "env.kwargs={image_size: 8}"))
    assert_one_line_exit_2(result, "experience_rank0.h5: key 'obs/image' is uint8[20, 20, 3]", "uint8[8, 8, 3]")
