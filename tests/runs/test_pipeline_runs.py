"""env.pipeline_stages in runs of the split layout (one trainer, one inference rank, one env rank): two stages give
the run of one stage byte for byte (the sync engine, and the async one at lag 0), and act alike where a smaller
forward pass rounds differently (whole episodes in groups with chunks, a recurrent policy's state per stage); a run
of four stages resumes exactly; a stage whose env stalls is named in one line within dist.timeout_s; a config that
cannot have stages exits 2 in one line."""

from __future__ import annotations

import pytest
from harness.runs import TINY, assert_one_line_exit_2, assert_same_run, records_without_timings, run_main

from spmd_rl.runtime.errors import COMM_ERROR_EXIT_CODE, USER_CODE_EXIT_CODE

SPLIT3 = ["layout.mode=split", "layout.trainer=1", "layout.inference=1", "layout.env=1"]
PPO_WINDOWS = ["--config", TINY, *SPLIT3, "env.num_envs=8", "env.vectorization=sync", "train.total_steps=512"]
GRPO_EPISODES = [
    *SPLIT3,
    "env.id=Pendulum-v1",
    "algo.class=grpo",
    "env.num_envs=16",  # a stage's Gaussian noise, 8 envs x 2 actions, is a whole block of 16 (docs/launching.md)
    "env.group_size=2",
    "env.action_chunk=2",
    "env.max_episode_steps=12",
    "algo.num_minibatches=2",
    "policy.hidden_sizes=[16]",
    "train.total_steps=576",  # 3 iterations of 6 decisions x 16 envs x 2 steps
    "log.progress=false",
    "log.tensorboard=false",
]
RECURRENT = [
    "--config",
    TINY,
    *SPLIT3,
    "algo.class=spmd_rl.algorithms.recurrent_ppo:RecurrentPPO",
    "policy.recurrent_size=8",
    "policy.hidden_sizes=[8]",
    "algo.num_minibatches=2",
    "env.num_envs=4",
    "env.vectorization=sync",
    "train.total_steps=256",
]


@pytest.mark.parametrize(
    "config, engine",
    [(PPO_WINDOWS, ["engine.class=sync"]), (PPO_WINDOWS, ["engine.class=async", "engine.max_policy_lag=0"])],
    ids=["sync", "async-lag0"],
)
def test_two_stages_give_the_run_of_one_stage(tmp_path, config, engine):
    one = run_main(*config, *engine, f"run.dir={tmp_path / 'one'}", nproc=3)
    assert one.returncode == 0, one.stderr[-2000:]
    two = run_main(*config, *engine, "env.pipeline_stages=2", f"run.dir={tmp_path / 'two'}", nproc=3)
    assert two.returncode == 0, two.stderr[-2000:]
    assert_same_run(tmp_path / "one", tmp_path / "two")


@pytest.mark.parametrize("config", [GRPO_EPISODES, RECURRENT], ids=["grpo-episodes-groups-chunks", "recurrent"])
def test_two_stages_act_alike_where_smaller_batches_round_differently(tmp_path, config):
    """The same episodes (whole ones in groups with chunks; a recurrent policy's state per stage) and returns; the
    policy's outputs (log-probabilities) of a forward pass of half the envs may round differently in their last bits
    (the matrix kernels depend on the batch), which the losses then show (docs/launching.md, pipeline stages)."""
    one = run_main(*config, f"run.dir={tmp_path / 'one'}", nproc=3)
    assert one.returncode == 0, one.stderr[-2000:]
    two = run_main(*config, "env.pipeline_stages=2", f"run.dir={tmp_path / 'two'}", nproc=3)
    assert two.returncode == 0, two.stderr[-2000:]
    records_one, records_two = records_without_timings(tmp_path / "one"), records_without_timings(tmp_path / "two")
    assert len(records_one) == len(records_two) >= 3
    for a, b in zip(records_one, records_two, strict=True):
        assert a.keys() == b.keys()
        for key in ("env_steps", "episodes", "episode_return_mean", "episode_length_mean", "outcome_mean"):
            assert a.get(key) == b.get(key), key
        assert all(b[key] == (a[key] if a[key] is None else pytest.approx(a[key], rel=1e-3, abs=1e-6)) for key in a)


def test_a_run_of_four_stages_resumes_exactly(tmp_path):
    config = [*PPO_WINDOWS[:-1], "env.pipeline_stages=4", "train.total_steps=768"]
    full = run_main(*config, f"run.dir={tmp_path / 'full'}", nproc=3)
    assert full.returncode == 0, full.stderr[-2000:]
    stopped = run_main(*config, f"run.dir={tmp_path / 'parts'}", "run.stop_after_iterations=3", nproc=3)
    assert stopped.returncode == 75, stopped.stderr[-2000:]
    resumed = run_main(*config, f"run.dir={tmp_path / 'parts'}", nproc=3)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resuming from" in resumed.stdout
    assert_same_run(tmp_path / "full", tmp_path / "parts")


def test_a_stalled_stage_is_named_with_its_rank_in_one_line_within_the_timeout(tmp_path):
    result = run_main(
        "--config",
        TINY,
        *SPLIT3,
        "env.id=tests.harness.stalling_env:StallingCartPole-v0",
        "env.vectorization=sync",
        "env.pipeline_stages=2",
        "train.seed=0",
        # the bound covers start-up's user code too (building the policy, its first act): 3 s failed there once
        # at load 5 on 2 cores, before any stage stalled
        "dist.timeout_s=10",
        f"run.dir={tmp_path / 'run'}",
        nproc=3,
        timeout=120,
    )
    # The env rank's own line names the stalled stage; the inference rank's names the stage it waited for; the job
    # summary names the env rank as the first to fail. Which rank's code the job ends with is a race.
    assert result.returncode in (COMM_ERROR_EXIT_CODE, USER_CODE_EXIT_CODE), result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    stalled = "rank 2 (env 0): env.step of tests.harness.stalling_env:StallingCartPole-v0 in pipeline stage 1 did not"
    assert any(stalled in line and "within 10 s" in line for line in lines), result.stderr[-3000:]
    assert any("rank 1 (inference 0)" in line and "'observations stage 1' from rank 2" in line for line in lines)
    # The summary names the env rank first either way: by its record ('failed first'), or, when its watchdog spoke
    # over COLLECT_GRACE_S after rank 0's own wait expired (start-up's steps before the stall, at load), as the rank
    # the others waited on that left no record in time ('stopped responding first').
    blamed = ("job summary: rank 2 (env 0) failed first", "job summary: rank 2 (env 0) stopped responding first")
    assert any(phrase in line for line in lines for phrase in blamed), result.stderr[-3000:]


def test_stages_where_nothing_overlaps_exit_2_in_one_line(tmp_path):
    result = run_main("--config", TINY, "env.pipeline_stages=2", f"run.dir={tmp_path / 'run'}")
    assert_one_line_exit_2(result, "env.pipeline_stages=2", "use layout.mode=split")
