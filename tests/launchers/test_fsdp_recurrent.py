"""Recurrent PPO on sharded trainers beyond one process, real runs of spmd_rl.main: colocated 2 with
train.parallel=fsdp equals ddp on the same data within float error (the GRU's and the heads' parameters sharded by
FSDP2); in one process, colocated 2, split 5 with 2 fsdp trainers and the async engine it resumes exactly; with a
policy lag (V-trace) the async engine runs it to the end. GRU cells but in split 5 (an LSTM there)."""

from __future__ import annotations

import pytest
import torch
import yaml
from harness.parts import RECURRENT_TINY
from harness.runs import assert_fsdp_equals_ddp, assert_same_run, run_main

RECURRENT = [
    "--config",
    "configs/ppo_cartpole_recurrent.yaml",
    "env.num_envs=4",
    "algo.num_steps=32",
    "algo.update_epochs=2",
    "train.total_steps=1024",
    "train.seed=4",
    "log.progress=false",
    "log.tensorboard=false",
]
# 2 trainers, each learning from its own env rank's sequences; the GRU's state lives on the inference rank.
SPLIT5 = ["layout.mode=split", "layout.trainer=2", "layout.inference=1", "layout.env=2"]
LAYOUTS = {  # name: (processes, overrides)
    "one-process": (0, []),
    "colocated-2": (2, []),
    # An LSTM (two state tensors on the inference rank), bf16 on the wire, a checksum after every sync.
    "split-5-lstm": (5, [*SPLIT5, "policy.cell=lstm", "inference.dtype=bf16", "weights.verify_every=1"]),
    "async-split-5-lag-0": (5, [*SPLIT5, "engine.class=async"]),  # lag 0: the sync engine's run, exactly
}


def _tiny_config(tmp_path) -> list[str]:
    """Plain CartPole (its state is saved in checkpoints: the masked one's wrapper is not), 4 iterations."""
    config = tmp_path / "recurrent.yaml"
    config.write_text(yaml.safe_dump({**RECURRENT_TINY, "dist": {"timeout_s": 60}}))
    return ["--config", str(config), "env.num_envs=2", "train.total_steps=256", "train.parallel=fsdp"]


@pytest.mark.slow
def test_recurrent_ppo_fsdp_equals_ddp_colocated_two_ranks(tmp_path):
    assert_fsdp_equals_ddp(RECURRENT, tmp_path, nproc=2, timeout=600)
    assert list((tmp_path / "fsdp" / "checkpoints").glob("iter_*/shards/.metadata"))


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_recurrent_ppo_fsdp_resume_is_exact(tmp_path, layout):
    """N iterations in one go equal N/2, a stop and a resume: metrics and policy.pt byte for byte, with each
    trainer's shards of the GRU, the heads and Adam's state in DCP files."""
    nproc, overrides = LAYOUTS[layout]
    args = [*_tiny_config(tmp_path), *overrides]
    full = run_main(*args, f"run.dir={tmp_path / 'full'}", nproc=nproc, timeout=600)
    assert full.returncode == 0, full.stdout + full.stderr
    stop = [*args, f"run.dir={tmp_path / 'halves'}", "run.stop_after_iterations=2"]
    stopped = run_main(*stop, nproc=nproc, timeout=600)
    assert stopped.returncode == 75, stopped.stdout + stopped.stderr
    trainers = 1 if not nproc else 2
    assert len(list((tmp_path / "halves" / "checkpoints").glob("iter_*/shards/*.distcp"))) == trainers
    resumed = run_main(*stop, nproc=nproc, timeout=600)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resuming from" in resumed.stdout + resumed.stderr
    assert_same_run(tmp_path / "full", tmp_path / "halves")


@pytest.mark.slow
def test_recurrent_ppo_fsdp_runs_in_the_async_engine_with_a_policy_lag(tmp_path):
    """With a lag the run depends on timing (docs/async.md), so it is not compared: it ends, every iteration
    logged, with finite weights."""
    args = [*_tiny_config(tmp_path), *SPLIT5, "engine.class=async", "engine.max_policy_lag=2", "algo.vtrace=true"]
    result = run_main(*args, f"run.dir={tmp_path / 'run'}", nproc=5, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 4
    policy = torch.load(tmp_path / "run" / "policy.pt", weights_only=True)
    assert all(torch.isfinite(v).all() for v in policy.values() if v.is_floating_point())
