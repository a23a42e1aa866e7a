"""Recurrent PPO on sharded trainers beyond one process: colocated 2 with train.parallel=fsdp equals ddp on the same
data within float error (the GRU's and the heads' parameters sharded by FSDP2), real runs of spmd_rl.main."""

from __future__ import annotations

import pytest
import torch
from harness.runs import run_main

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


@pytest.mark.slow
def test_recurrent_ppo_fsdp_equals_ddp_colocated_two_ranks(tmp_path):
    for parallel in ("ddp", "fsdp"):
        result = run_main(
            *RECURRENT, f"train.parallel={parallel}", f"run.dir={tmp_path / parallel}", nproc=2, timeout=600
        )
        assert result.returncode == 0, result.stdout + result.stderr
    ddp, fsdp = (torch.load(tmp_path / p / "policy.pt", weights_only=True) for p in ("ddp", "fsdp"))
    assert sorted(ddp) == sorted(fsdp)
    for key in ddp:
        assert torch.allclose(ddp[key].double(), fsdp[key].double(), atol=1e-5, rtol=0), key
    assert list((tmp_path / "fsdp" / "checkpoints").glob("iter_*/shards/.metadata"))
