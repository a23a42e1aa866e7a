"""One FSDP trainer in a split layout (train.parallel=fsdp, layout.trainer=1): the trainer shards over its own
group, so it holds every row, not ceil(rows / world size) of them. Every algorithm family and the async engine run,
a stop and a resume equal the uninterrupted run, and a checkpoint of 2 sharded trainers reshards onto 1 in split."""

from __future__ import annotations

import pytest
import torch
from harness.runs import assert_resumed_byte_for_byte, records_without_timings, run_main

TINY = ["--config", "configs/ci_tiny.yaml", "train.seed=3", "train.parallel=fsdp"]
SPLIT3 = ["layout.mode=split", "layout.trainer=1", "layout.inference=1", "layout.env=1"]
QUIET = ["log.progress=false", "log.tensorboard=false"]
SAC = [
    "--config",
    "configs/sac_pendulum.yaml",
    "policy.hidden_sizes=[32,32]",
    "algo.critic_hidden_sizes=[32,32]",
    "algo.batch_size=64",
    "algo.learning_starts=64",
    "train.total_steps=192",
]
RECURRENT = ["--config", "configs/ppo_cartpole_recurrent.yaml", "env.num_envs=2", "algo.num_steps=16"]
TRANSFORMER = ["--config", "configs/ppo_cartpole_transformer.yaml", "env.total_envs=2", "algo.num_steps=16"]


def _shard_files(run_dir) -> list:
    return list(run_dir.glob("checkpoints/iter_*/shards/*.distcp"))


@pytest.mark.parametrize(
    "args",
    [
        [*SAC, "train.parallel=fsdp"],
        [*RECURRENT, "train.parallel=fsdp", "train.total_steps=128"],
        [*TRANSFORMER, "train.parallel=fsdp", "train.total_steps=128"],
    ],
    ids=["sac", "recurrent-ppo", "transformer"],
)
def test_one_fsdp_trainer_in_split_runs(tmp_path, args):
    result = run_main(*args, *SPLIT3, *QUIET, f"run.dir={tmp_path}", nproc=3, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert (tmp_path / "finished.json").exists() and len(_shard_files(tmp_path)) == 1


def test_one_fsdp_trainer_in_the_shipped_async_layout_runs(tmp_path):
    """The async config's own layout (1 trainer, 1 inference rank, 4 env ranks) with train.parallel=fsdp."""
    args = ["--config", "configs/ppo_cartpole_async.yaml", "train.parallel=fsdp", "train.total_steps=768", *QUIET]
    result = run_main(*args, f"run.dir={tmp_path}", nproc=6, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert (tmp_path / "finished.json").exists() and len(_shard_files(tmp_path)) == 1


ASYNC_LAG_0 = [*TINY, "engine.class=async", "engine.max_policy_lag=0"]


@pytest.mark.parametrize(
    "algorithm",
    [
        TINY,
        [*SAC, "train.parallel=fsdp"],
        # plain CartPole: the masked one's wrapper keeps no state in checkpoints, so its episodes restart on resume
        [*RECURRENT, "env.id=CartPole-v1", "train.parallel=fsdp", "train.total_steps=128"],
        [*TRANSFORMER, "train.parallel=fsdp", "train.total_steps=128"],
        ASYNC_LAG_0,
    ],
    ids=["ppo", "sac", "recurrent-ppo", "transformer", "async"],
)
def test_one_fsdp_trainer_in_split_resumes_exactly(tmp_path, algorithm):
    """N iterations in one go equal N/2, a stop and a resume: metrics and policy.pt byte for byte (the async engine
    at lag 0, where it is exact)."""
    args = [*algorithm, *SPLIT3, *QUIET]
    whole = run_main(*args, f"run.dir={tmp_path / 'whole'}", nproc=3)
    assert whole.returncode == 0, whole.stdout[-2000:] + whole.stderr[-3000:]
    iterations = len(records_without_timings(tmp_path / "whole"))
    half = run_main(*args, f"run.dir={tmp_path / 'halves'}", f"run.stop_after_iterations={iterations // 2}", nproc=3)
    assert half.returncode == 75, half.stdout[-2000:] + half.stderr[-3000:]
    resumed = run_main(*args, f"run.dir={tmp_path / 'halves'}", nproc=3)
    assert_resumed_byte_for_byte(resumed, tmp_path / "whole", tmp_path / "halves")


def test_two_sharded_trainers_reshard_to_one_in_split(tmp_path):
    """2 fsdp trainers' checkpoint (split 5) resumes on 1 trainer (split 4): DCP reshards the model and Adam's state
    onto the one trainer, and the run completes with every iteration logged once."""
    run_dir = tmp_path / "run"
    args = [*TINY, "env.total_envs=4", "train.total_steps=512", *QUIET, f"run.dir={run_dir}"]
    two = ["layout.mode=split", "layout.trainer=2", "layout.inference=1", "layout.env=2"]
    first = run_main(*args, *two, "run.stop_after_iterations=4", nproc=5)
    assert first.returncode == 75, first.stdout[-2000:] + first.stderr[-3000:]
    assert len(_shard_files(run_dir)) == 2
    one = ["layout.mode=split", "layout.trainer=1", "layout.inference=1", "layout.env=2"]
    resumed = run_main(*args, *one, nproc=4)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    assert "data order differs" in resumed.stdout
    records = records_without_timings(run_dir)
    assert [r["iteration"] for r in records] == list(range(8))
    policy = torch.load(run_dir / "policy.pt", weights_only=True)
    assert all(torch.isfinite(v).all() for v in policy.values() if v.is_floating_point())
