"""GRPO end to end in one process: whole-episode rollouts of groups with action chunks, the KL to the reference
policy and dynamic sampling on; N iterations equal N/2, a stop and a resume, line for line and byte for byte; and a
config without groups refused in one line."""

from __future__ import annotations

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
