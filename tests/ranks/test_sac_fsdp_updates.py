"""SAC on sharded trainers (train.parallel=fsdp): the actor, both critics and the target critics sharded with FSDP2,
their gradients reduce-scattered in backward (Context.shard / backward / reduce_gradients), the temperature averaged
by hand. Against DDP on the same batches, on real gloo ranks (whole runs: tests/launchers/test_sac_fsdp_runs.py)."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch
import torch.distributed as dist
from harness.multiproc import run_ranks
from harness.parts import random_transitions
from tensordict import TensorDict

from spmd_rl.algorithms.configs import SACConfig
from spmd_rl.algorithms.sac import SAC
from spmd_rl.api import Context
from spmd_rl.comm import sharding
from spmd_rl.modules.configs import SquashedGaussianConfig
from spmd_rl.modules.sac_td3_networks import SquashedGaussianActor

OBS = gym.spaces.Box(-np.inf, np.inf, (3,), np.float32)
ACTIONS = gym.spaces.Box(np.array([-2.0, 0.0], np.float32), np.array([1.0, 10.0], np.float32))


def batch_of(size: int, seed: int) -> TensorDict:
    return random_transitions(ACTIONS, size, seed, terminated_fraction=0.2)


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


def test_bf16_reaches_the_critics_and_the_actor_and_their_outputs_stay_float32(tmp_path):
    """train.precision=bf16 through Context.shard: the critics and the actor compute in bfloat16 (the Q values
    differ from float32 ones by bf16 rounding) and hand float32 to the loss math."""
    qs = {}
    for precision in ("fp32", "bf16"):
        torch.manual_seed(0)
        actor = SquashedGaussianActor(OBS, ACTIONS, SquashedGaussianConfig(hidden_sizes=[32, 32]))
        sac = SAC(actor, SACConfig(critic_hidden_sizes=[32, 32]), Context.local(OBS, ACTIONS, precision=precision))
        batch = batch_of(16, seed=0)
        q1, _ = sac.critic(sac.actor.features(batch["obs"]), batch["action"])
        action, log_prob = sac.actor.sample(batch["obs"])
        assert q1.dtype == action.dtype == log_prob.dtype == torch.float32
        qs[precision] = q1.detach()
        sac.update(batch)  # a whole update runs
    assert not torch.equal(qs["fp32"], qs["bf16"])
    assert torch.allclose(qs["fp32"], qs["bf16"], atol=0.05)
