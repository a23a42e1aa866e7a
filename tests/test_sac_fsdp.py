"""SAC on sharded trainers (train.parallel=fsdp): the actor, both critics and the target critics sharded with FSDP2,
their gradients reduce-scattered in backward (Context.shard / backward / reduce_gradients), the temperature averaged
by hand. Against DDP on the same batches, on real gloo ranks; and whole runs that stop and resume exactly."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch
import torch.distributed as dist
from tensordict import TensorDict

from spmd_rl.algorithms.configs import SACConfig
from spmd_rl.algorithms.sac import SAC
from spmd_rl.api import Context
from spmd_rl.comm import sharding
from spmd_rl.modules.configs import SquashedGaussianConfig
from spmd_rl.modules.sac_networks import SquashedGaussianActor
from tests.multiproc import run_ranks

ROOT = Path(__file__).resolve().parent.parent
OBS = gym.spaces.Box(-np.inf, np.inf, (3,), np.float32)
ACTIONS = gym.spaces.Box(np.array([-2.0, 0.0], np.float32), np.array([1.0, 10.0], np.float32))


def batch_of(size: int, seed: int) -> TensorDict:
    generator = torch.Generator().manual_seed(seed)
    low, high = torch.as_tensor(ACTIONS.low), torch.as_tensor(ACTIONS.high)
    return TensorDict(
        obs=torch.randn(size, 3, generator=generator),
        action=low + (high - low) * torch.rand(size, 2, generator=generator),
        reward=torch.randn(size, generator=generator),
        next_obs=torch.randn(size, 3, generator=generator),
        terminated=torch.rand(size, generator=generator) < 0.2,
        batch_size=[size],
    )


def full_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Whole parameters and buffers, gathered from shards where they are DTensors (a collective)."""
    return {
        name: (value.full_tensor() if sharding.is_dtensor(value) else value).detach().clone()
        for name, value in module.state_dict().items()
    }


def _updates(rank: int, world_size: int, out: str, parallel: str, micro_batch_size: int, autotune: bool) -> None:
    """Every trainer updates SAC on its own half of each batch, as ShardedReplay hands it out."""
    torch.set_num_threads(1)
    group = dist.group.WORLD if world_size > 1 else None
    torch.manual_seed(0)
    actor = SquashedGaussianActor(OBS, ACTIONS, SquashedGaussianConfig(hidden_sizes=[32, 32], normalize_obs=True))
    config = SACConfig(
        critic_hidden_sizes=[32, 32], critic_activation="relu", micro_batch_size=micro_batch_size, autotune=autotune
    )
    sac = SAC(actor, config, Context.local(OBS, ACTIONS, group=group, parallel=parallel, run_dir=out))
    sharded = [sharding.is_dtensor(p) for p in [*sac.actor_params, *sac.critic_params, *sac.target_params]]
    assert all(sharded) if parallel == "fsdp" else not any(sharded)
    metrics = []
    for step in range(6):  # 3 actor catch-ups (policy_frequency 2), Polyak on every call
        batch = batch_of(32 * world_size, seed=step)
        mine = batch[rank * 32 : (rank + 1) * 32]
        torch.manual_seed(100 * step + rank)  # the actor's reparameterization noise
        metrics.append(sac.update(mine))
    state = {
        "actor": full_tensors(sac.actor),
        "critic": full_tensors(sac.critic),
        "critic_target": full_tensors(sac.critic_target),
        "log_alpha": sac.log_alpha.detach().clone(),
        "metrics": metrics,
    }
    frozen_grads = [p for p in sac.target_params if p.grad is not None]
    assert not frozen_grads, "target critics got gradients"
    if rank == 0:
        torch.save(state, f"{out}/{parallel}.pt")


@pytest.mark.parametrize(
    "micro_batch_size,autotune", [(0, True), (16, True), (0, False)], ids=["whole", "micro-batches", "fixed-alpha"]
)
def test_sharded_sac_updates_equal_ddp_on_two_ranks(tmp_path, micro_batch_size, autotune):
    import torch.optim  # noqa: F401 - imported by the parent so the forked ranks need not (torch._dynamo: seconds)

    for parallel in ("ddp", "fsdp"):
        codes = run_ranks(_updates, 2, str(tmp_path), parallel, micro_batch_size, autotune, timeout_s=60)
        assert codes == [0, 0], parallel
    ddp, fsdp = (torch.load(tmp_path / f"{p}.pt", weights_only=True) for p in ("ddp", "fsdp"))
    for part in ("actor", "critic", "critic_target"):
        assert sorted(ddp[part]) == sorted(fsdp[part])
        for key in ddp[part]:
            assert torch.allclose(ddp[part][key], fsdp[part][key], atol=1e-5, rtol=0), f"{part}.{key}"
    assert torch.allclose(ddp["log_alpha"], fsdp["log_alpha"], atol=1e-6)
    for before, after in zip(ddp["metrics"], fsdp["metrics"]):
        assert before.keys() == after.keys()
        for name in before:
            assert abs(before[name] - after[name]) < 1e-4, name


# -- runs --------------------------------------------------------------------------------------------------------

SMALL = [
    "policy.hidden_sizes=[32,32]",
    "algo.critic_hidden_sizes=[32,32]",
    "algo.batch_size=64",
    "train.seed=2",
    "train.parallel=fsdp",
    "log.progress=false",
    "log.tensorboard=false",
]
SAC_SMALL = ["--config", "configs/sac_pendulum.yaml", *SMALL, "algo.learning_starts=128", "train.total_steps=384"]


def _env() -> dict:
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore")
    env.pop("RANK", None)
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(*args, nproc: int = 0, timeout: float = 300) -> subprocess.CompletedProcess:
    launcher = [sys.executable, "-m", "spmd_rl.main"]
    if nproc:
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
    return subprocess.run(launcher + list(args), cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)


def metrics_without_timings(run_dir: Path) -> list[dict]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [
        {k: v for k, v in r.items() if not (k.startswith("time_") or "sps" in k or k.endswith("_s"))} for r in records
    ]


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [0, 2], ids=["one-process", "colocated2"])
def test_sharded_sac_resume_is_exact(tmp_path, nproc):
    """N iterations in one go equal N/2, a stop and a resume: metrics and policy.pt byte for byte, with the actor,
    the critics, the target critics and the three Adam states in DCP shard files and the replay shards in the rank
    files."""
    whole = main(*SAC_SMALL, f"run.dir={tmp_path / 'whole'}", nproc=nproc)
    assert whole.returncode == 0, whole.stdout + whole.stderr
    records = metrics_without_timings(tmp_path / "whole")
    assert any("qf_loss" in r for r in records[len(records) // 2 :])  # the second half learns
    half = main(
        *SAC_SMALL, f"run.dir={tmp_path / 'halves'}", f"run.stop_after_iterations={len(records) // 2}", nproc=nproc
    )
    assert half.returncode == 75 if not nproc else half.returncode != 0, half.stdout + half.stderr
    shards = list((tmp_path / "halves" / "checkpoints").glob("iter_*/shards/*.distcp"))
    assert len(shards) == max(nproc, 1)
    resumed = main(*SAC_SMALL, f"run.dir={tmp_path / 'halves'}", nproc=nproc)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resuming from" in resumed.stdout + resumed.stderr
    assert metrics_without_timings(tmp_path / "whole") == metrics_without_timings(tmp_path / "halves")
    assert (tmp_path / "whole" / "policy.pt").read_bytes() == (tmp_path / "halves" / "policy.pt").read_bytes()


@pytest.mark.slow
def test_sharded_sac_runs_split_with_the_async_engine_and_a_bf16_wire(tmp_path):
    """Split 5 (2 fsdp trainers, 1 inference rank, 2 env ranks), the async engine: each trainer sends its shards of
    the actor, in bf16, to the inference rank's staging copy, checked against the gathered buckets every sync."""
    result = main(
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
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "finished.json").exists()
    assert list((tmp_path / "checkpoints").glob("iter_*/shards/.metadata"))
    records = metrics_without_timings(tmp_path)
    assert any(r.get("qf_loss", float("nan")) == r.get("qf_loss") for r in records)  # learned, finite
    policy = torch.load(tmp_path / "policy.pt", weights_only=True)
    assert all(torch.isfinite(v).all() for v in policy.values() if v.is_floating_point())
