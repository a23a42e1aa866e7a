"""GRPO end to end in one process: whole-episode rollouts of groups with action chunks, the KL to the reference
policy and dynamic sampling on; N iterations equal N/2, a stop and a resume, line for line and byte for byte; and a
config without groups refused in one line."""

from __future__ import annotations

import pytest
from harness.runs import assert_one_line_exit_2, assert_same_run, read_metrics, run_main

GRPO_TINY = [
    "env.id=Pendulum-v1",
    "algo.class=grpo",
    "env.num_envs=8",
    "env.group_size=4",
    "env.action_chunk=2",
    "env.max_episode_steps=20",
    "algo.kl_coef=0.1",
    "algo.filter_groups=true",
    "algo.num_minibatches=2",
    "policy.hidden_sizes=[16]",
    "train.total_steps=1280",  # 8 iterations of 10 decisions x 8 envs x 2 steps
    "log.progress=false",
    "log.tensorboard=false",
]


def test_grpo_runs_whole_episodes_in_groups_and_resumes_exactly(tmp_path):
    full = run_main(*GRPO_TINY, f"run.dir={tmp_path / 'full'}")
    assert full.returncode == 0, full.stderr[-2000:]
    assert "rollouts of whole episodes from a reset (10 decisions" in full.stdout
    records = read_metrics(tmp_path / "full")
    assert [r["env_steps"] for r in records] == [160 * (i + 1) for i in range(8)]
    last = records[-1]
    assert {"policy_loss", "kl_ref", "outcome_mean", "dropped_group_fraction", "minibatch_steps"} <= set(last)
    assert last["dropped_group_fraction"] == 0.0  # Pendulum's returns are never equal within a group
    # env.max_episode_steps truncates every episode at 20 primitive steps: 8 episodes per rollout, each reported.
    assert all(r["episodes"] == 8 * (i + 1) and r["episode_length_mean"] == 20.0 for i, r in enumerate(records))

    stopped = run_main(*GRPO_TINY, f"run.dir={tmp_path / 'split'}", "run.stop_after_iterations=4")
    assert stopped.returncode == 75, stopped.stderr[-2000:]
    resumed = run_main(*GRPO_TINY, f"run.dir={tmp_path / 'split'}")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resuming from" in resumed.stdout
    assert_same_run(tmp_path / "full", tmp_path / "split")


def test_grpo_without_groups_is_refused_in_one_line(tmp_path):
    result = run_main("env.id=Pendulum-v1", "algo.class=grpo", f"run.dir={tmp_path / 'run'}")
    assert_one_line_exit_2(result, "set env.group_size to 2 or more")


INSTRUCTED = [
    "env.id=tests.harness.instructed_env:Instructed-v0",
    "algo.class=grpo",
    "env.num_envs=8",
    "env.group_size=4",
    "env.max_episode_steps=4",
    "train.total_steps=96",  # 3 iterations of 4 decisions x 8 envs
    "log.progress=false",
    "log.tensorboard=false",
]


@pytest.mark.parametrize("outcome", ["auto", "return"])
def test_an_env_that_reports_success_is_judged_by_it_unless_return_is_asked(tmp_path, outcome):
    result = run_main(*INSTRUCTED, f"algo.outcome={outcome}", f"run.dir={tmp_path / 'run'}")
    assert result.returncode == 0, result.stderr[-2000:]
    records = read_metrics(tmp_path / "run")
    # One episode per env column per rollout, every one reported: the outcomes' mean is the iteration's success
    # rate, or (its first iteration: the return's mean runs over the last 100 episodes) the return's mean.
    assert [r["episodes"] for r in records] == [8, 16, 24]
    if outcome == "auto":
        assert all(r["outcome_mean"] == pytest.approx(r["success_rate"]) for r in records)
    else:
        assert records[0]["outcome_mean"] == pytest.approx(records[0]["episode_return_mean"])
    assert records[0]["episode_return_mean"] > 1.0  # a return counts the steps that picked the target


def test_a_success_outcome_on_an_env_without_a_success_flag_is_refused_in_one_line(tmp_path):
    result = run_main(*GRPO_TINY, "algo.outcome=success", f"run.dir={tmp_path / 'run'}")
    assert_one_line_exit_2(result, "records only for an env whose step info has a success flag")


REFILL_ROUNDS = [
    *(arg for arg in INSTRUCTED if not arg.startswith("train.total_steps=")),
    "algo.max_resample_rounds=3",
    "train.total_steps=192",  # 6 iterations
]
REFILL = [*REFILL_ROUNDS, "algo.filter_groups=true"]


def test_dynamic_sampling_refills_the_batch_with_extra_rollouts_and_resumes_exactly(tmp_path):
    full = run_main(*REFILL, f"run.dir={tmp_path / 'full'}")
    assert full.returncode == 0, full.stderr[-2000:]
    assert "groups with equal outcomes dropped and refilled by up to 3 extra rollouts" in full.stdout
    records = read_metrics(tmp_path / "full")
    rounds = [r["resample_rounds"] for r in records]
    # Most groups of Instructed-v0 succeed whole at random (a target of 2 in 4 steps): extra rounds are rolled, as
    # many as needed and no more than allowed, each a rollout of every env (32 steps).
    assert any(rounds) and all(0 <= n <= 3 for n in rounds), rounds
    assert all(r["resampled_env_steps"] == 32 * r["resample_rounds"] for r in records)
    assert [r["env_steps"] for r in records] == [32 * (i + 1) for i in range(6)]  # the plan's steps alone

    stopped = run_main(*REFILL, f"run.dir={tmp_path / 'split'}", "run.stop_after_iterations=3")
    assert stopped.returncode == 75, stopped.stderr[-2000:]
    resumed = run_main(*REFILL, f"run.dir={tmp_path / 'split'}")
    assert resumed.returncode == 0 and "resuming from" in resumed.stdout, resumed.stderr[-2000:]
    assert_same_run(tmp_path / "full", tmp_path / "split")


def test_colocated_trainers_roll_the_same_extra_rounds(tmp_path):
    result = run_main(*REFILL, "layout.mode=colocated", "env.total_envs=16", f"run.dir={tmp_path}", nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    assert any(r["resample_rounds"] for r in read_metrics(tmp_path))


def test_a_refill_without_filtering_is_refused_in_one_line(tmp_path):
    result = run_main(*REFILL_ROUNDS, "algo.filter_groups=false", f"run.dir={tmp_path / 'run'}")
    assert_one_line_exit_2(result, "algo.max_resample_rounds=3", "refills the groups algo.filter_groups drops")
