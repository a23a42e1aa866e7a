"""env.pipeline_stages in one process (the colocated layout, env.vectorization=async): each stage's envs step on a
thread of their own while the policy acts for the next stage. Two stages give the run of one stage byte for byte; a
run of two stages (whole episodes in groups, which a resume restarts exactly though the worker processes' envs are
not saved) resumes exactly; a stalled stage is named in one line within dist.timeout_s; an in-process vectorizer,
where nothing would overlap, exits 2 in one line."""

from __future__ import annotations

from harness.runs import TINY, assert_halves_equal_whole, assert_one_line_exit_2, assert_same_run, run_main

from spmd_rl.runtime.errors import USER_CODE_EXIT_CODE

PPO_ASYNC = ["--config", TINY, "env.num_envs=8", "env.vectorization=async", "train.total_steps=512"]
GRPO_EPISODES = [
    "--config",
    TINY,
    "env.id=Pendulum-v1",
    "env.vectorization=async",
    "algo.class=grpo",
    "env.num_envs=4",
    "env.group_size=2",
    "env.max_episode_steps=8",
    "policy.hidden_sizes=[16]",
    "train.total_steps=160",  # 5 iterations of 8 steps x 4 envs
    "checkpoint.every_iterations=1",
]


def test_two_stages_in_one_process_give_the_run_of_one_stage(tmp_path):
    one = run_main(*PPO_ASYNC, f"run.dir={tmp_path / 'one'}")
    assert one.returncode == 0, one.stderr[-2000:]
    two = run_main(*PPO_ASYNC, "env.pipeline_stages=2", f"run.dir={tmp_path / 'two'}")
    assert two.returncode == 0, two.stderr[-2000:]
    assert_same_run(tmp_path / "one", tmp_path / "two")


def test_two_stages_in_one_process_resume_exactly(tmp_path):
    assert_halves_equal_whole([*GRPO_EPISODES, "env.pipeline_stages=2"], tmp_path, half=2)


def test_a_stalled_stage_in_one_process_is_named_in_one_line_within_the_timeout(tmp_path):
    result = run_main(
        "--config",
        TINY,
        "env.id=tests.harness.stalling_env:StallingCartPole-v0",
        "env.vectorization=async",
        "env.pipeline_stages=2",
        "train.seed=0",
        "dist.timeout_s=10",
        f"run.dir={tmp_path / 'run'}",
        timeout=120,
    )
    assert result.returncode == USER_CODE_EXIT_CODE, result.stderr[-3000:]
    # The line names the stage and, as the envs step in a worker process, how that worker was started
    stalled = "env.step of tests.harness.stalling_env:StallingCartPole-v0 in pipeline stage 1 (in 1 env worker process"
    assert any(stalled in line and "did not return within 10 s" in line for line in result.stderr.splitlines()), (
        result.stderr[-3000:]
    )


def test_stages_with_an_in_process_vectorizer_exit_2_in_one_line(tmp_path):
    result = run_main("--config", TINY, "env.vectorization=sync", "env.pipeline_stages=2", f"run.dir={tmp_path / 'r'}")
    assert_one_line_exit_2(result, "env.pipeline_stages=2", "env.vectorization=sync", "set env.vectorization=async")
