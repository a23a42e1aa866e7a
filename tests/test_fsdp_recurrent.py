"""Recurrent PPO on sharded trainers beyond one process: colocated 2 with train.parallel=fsdp equals ddp on the same
data within float error (the GRU's and the heads' parameters sharded by FSDP2), real runs of spmd_rl.main."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(*args, nproc: int, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore")
    env.pop("RANK", None)
    launcher = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        "--rdzv_backend=c10d",
        f"--rdzv_endpoint=127.0.0.1:{_free_port()}",
        "-m",
        "spmd_rl.main",
    ]
    return subprocess.run(launcher + list(args), cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_recurrent_ppo_fsdp_equals_ddp_colocated_two_ranks(tmp_path):
    for parallel in ("ddp", "fsdp"):
        result = torchrun(*RECURRENT, f"train.parallel={parallel}", f"run.dir={tmp_path / parallel}", nproc=2)
        assert result.returncode == 0, result.stdout + result.stderr
    ddp, fsdp = (torch.load(tmp_path / p / "policy.pt", weights_only=True) for p in ("ddp", "fsdp"))
    assert sorted(ddp) == sorted(fsdp)
    for key in ddp:
        assert torch.allclose(ddp[key].double(), fsdp[key].double(), atol=1e-5, rtol=0), key
    assert list((tmp_path / "fsdp" / "checkpoints").glob("iter_*/shards/.metadata"))
