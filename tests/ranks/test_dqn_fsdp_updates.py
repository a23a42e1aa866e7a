"""DQN on sharded trainers (train.parallel=fsdp): the online and the target Q-network sharded with FSDP2, the
gradients reduce-scattered in backward (Context.shard / backward / reduce_gradients), against DDP on the same
batches, on real gloo ranks."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch
import torch.distributed as dist
from harness.multiproc import run_ranks
from tensordict import TensorDict

from spmd_rl.algorithms.configs import DQNConfig
from spmd_rl.algorithms.dqn import DQN
from spmd_rl.api import Context
from spmd_rl.comm import sharding
from spmd_rl.modules.configs import QNetworkConfig
from spmd_rl.modules.q_network import QNetwork

OBS = gym.spaces.Box(-np.inf, np.inf, (3,), np.float32)
ACTIONS = gym.spaces.Discrete(4)


def batch_of(size: int, seed: int) -> TensorDict:
    generator = torch.Generator().manual_seed(seed)
    return TensorDict(
        obs=torch.randn(size, 3, generator=generator),
        action=torch.randint(0, 4, (size,), generator=generator),
        reward=torch.randn(size, generator=generator),
        next_obs=torch.randn(size, 3, generator=generator),
        discount=torch.where(torch.rand(size, generator=generator) < 0.2, 0.0, 0.99),
        batch_size=[size],
    )


def full_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Whole parameters and buffers, gathered from shards where they are DTensors (a collective)."""
    return {
        name: (value.full_tensor() if sharding.is_dtensor(value) else value).detach().clone()
        for name, value in module.state_dict().items()
    }


def _updates(rank: int, world_size: int, out: str, parallel: str, tau: float) -> None:
    """Every trainer updates DQN on its own half of each batch, as ShardedReplay hands it out."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    policy = QNetwork(OBS, ACTIONS, QNetworkConfig(hidden_sizes=[32, 32], normalize_obs=True))
    # A small max_grad_norm so that the clipping acts on every step; a target update after every step.
    config = DQNConfig(max_grad_norm=0.5, tau=tau, learning_rate=1e-2)
    context = Context.local(OBS, ACTIONS, group=dist.group.WORLD, parallel=parallel, run_dir=out)
    dqn = DQN(policy, config, context)
    sharded = [sharding.is_dtensor(p) for p in [*dqn.params, *dqn.target.parameters()]]
    assert all(sharded) if parallel == "fsdp" else not any(sharded)
    metrics = []
    for step in range(4):
        batch = batch_of(32 * world_size, seed=step)
        metrics.append(dqn.update(batch[rank * 32 : (rank + 1) * 32]))
        dqn.update_target()
    acted = dqn.q_network.act(batch_of(8, seed=9)["obs"], deterministic=True)["action"]
    state = {"online": full_tensors(dqn.q_network), "target": full_tensors(dqn.target), "metrics": metrics}
    assert not [p for p in dqn.target.parameters() if p.grad is not None], "the target network got gradients"
    if rank == 0:
        torch.save({**state, "acted": acted}, f"{out}/{parallel}.pt")


@pytest.mark.parametrize("tau", [1.0, 0.5], ids=["hard-copies", "polyak"])
def test_sharded_dqn_updates_equal_ddp_on_two_ranks(tmp_path, tau):
    import torch.optim  # noqa: F401 - imported by the parent so the forked ranks need not (torch._dynamo: seconds)

    for parallel in ("ddp", "fsdp"):
        codes = run_ranks(_updates, 2, str(tmp_path), parallel, tau, timeout_s=60)
        assert codes == [0, 0], parallel
    ddp, fsdp = (torch.load(tmp_path / f"{p}.pt", weights_only=True) for p in ("ddp", "fsdp"))
    torch.manual_seed(0)
    start = QNetwork(OBS, ACTIONS, QNetworkConfig(hidden_sizes=[32, 32], normalize_obs=True))
    for part in ("online", "target"):
        assert sorted(ddp[part]) == sorted(fsdp[part])
        for key in ddp[part]:
            assert torch.allclose(ddp[part][key], fsdp[part][key], atol=1e-5, rtol=0), f"{part}.{key}"
    # The updates moved the networks (the comparison is not of two untouched copies).
    assert not torch.allclose(ddp["online"]["q.0.weight"], start.state_dict()["q.0.weight"])
    assert torch.equal(ddp["acted"], fsdp["acted"])
    for before, after in zip(ddp["metrics"], fsdp["metrics"]):
        assert before.keys() == after.keys()
        for name in before:
            assert abs(before[name] - after[name]) < 1e-4, name
