"""SAC on sharded trainers (train.parallel=fsdp), whole runs: a stop and a resume equal the uninterrupted run in one
process and colocated 2 (the actor, critics, target critics and Adam states in DCP shard files, the replay shards in
the rank files), and the split layout with the async engine, each trainer sending its shards of the actor in bf16."""

from __future__ import annotations

import pytest
import torch
from harness.runs import assert_resumed_byte_for_byte, records_without_timings, run_main

SMALL = [
    "policy.hidden_sizes=[32,32]",
    "algo.critic_hidden_sizes=[32,32]",
    "algo.batch_size=64",
    "train.seed=2",
    "train.parallel=fsdp",
    "log.progress=false",
    "log.tensorboard=false",
]
SAC_SMALL = ["--config", "configs/sac_pendulum.yaml", *SMALL, "algo.learning_starts=96", "train.total_steps=256"]


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [0, 2], ids=["one-process", "colocated2"])
def test_sharded_sac_resume_is_exact(tmp_path, nproc):
    """N iterations in one go equal N/2, a stop and a resume: metrics and policy.pt byte for byte, with the actor,
    the critics, the target critics and the three Adam states in DCP shard files and the replay shards in the rank
    files."""
    whole = run_main(*SAC_SMALL, f"run.dir={tmp_path / 'whole'}", nproc=nproc, timeout=600)
    assert whole.returncode == 0, whole.stdout + whole.stderr
    records = records_without_timings(tmp_path / "whole")
    assert any("qf_loss" in r for r in records[len(records) // 2 :])  # the second half learns
    half = run_main(
        *SAC_SMALL,
        f"run.dir={tmp_path / 'halves'}",
        f"run.stop_after_iterations={len(records) // 2}",
        nproc=nproc,
        timeout=600,
    )
    assert half.returncode == 75 if not nproc else half.returncode != 0, half.stdout + half.stderr
    shards = list((tmp_path / "halves" / "checkpoints").glob("iter_*/shards/*.distcp"))
    assert len(shards) == max(nproc, 1)
    if nproc:  # another number of trainers: refused (each trainer's replay shard is its own), the run dir untouched
        refused = run_main(*SAC_SMALL, f"run.dir={tmp_path / 'halves'}", timeout=600)
        assert refused.returncode == 2, refused.stdout + refused.stderr
        assert "algo.class 'sac': each trainer's replay shard is its own" in refused.stderr, refused.stderr
    resumed = run_main(*SAC_SMALL, f"run.dir={tmp_path / 'halves'}", nproc=nproc, timeout=600)
    assert_resumed_byte_for_byte(resumed, tmp_path / "whole", tmp_path / "halves")


@pytest.mark.slow
def test_sharded_sac_runs_split_with_the_async_engine_and_a_bf16_wire(tmp_path):
    """Split 5 (2 fsdp trainers, 1 inference rank, 2 env ranks), the async engine: each trainer sends its shards of
    the actor, in bf16, to the inference rank's staging copy, checked against the gathered buckets every sync."""
    result = run_main(
        "--config",
        "configs/sac_pendulum_async.yaml",
        *SMALL,
        "train.total_steps=256",
        "algo.learning_starts=64",
        "layout.mode=split",
        "layout.trainer=2",
        "layout.inference=1",
        "layout.env=2",
        "inference.dtype=bf16",
        "weights.verify_every=1",
        f"run.dir={tmp_path}",
        nproc=5,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "finished.json").exists()
    assert list((tmp_path / "checkpoints").glob("iter_*/shards/.metadata"))
    records = records_without_timings(tmp_path)
    assert any(r.get("qf_loss", float("nan")) == r.get("qf_loss") for r in records)  # learned, finite
    policy = torch.load(tmp_path / "policy.pt", weights_only=True)
    assert all(torch.isfinite(v).all() for v in policy.values() if v.is_floating_point())
