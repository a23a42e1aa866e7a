"""Small pieces that tests of several modules build on: PPO and SAC configs, policies' spaces and batches, a
recurrent config, a Dict-observation wrapper, a Runtime for a forked rank and RunControl's iteration loop.

They lived in the test module that first needed them (test_ppo, test_sac, test_recurrent, test_evaluate,
test_agreement, test_run_control) and were imported from there; here no test module imports another.
"""

from __future__ import annotations

import dataclasses
import datetime
from types import SimpleNamespace

import gymnasium as gym
import numpy as np
import pytest
import torch
from tensordict import TensorDict
from torch import nn

from spmd_rl.algorithms.configs import PPOConfig, SACConfig
from spmd_rl.algorithms.ppo import PPO
from spmd_rl.api import Context
from spmd_rl.modules.actor_critic import ActorCritic
from spmd_rl.modules.configs import ActorCriticConfig, SquashedGaussianConfig
from spmd_rl.persist.run_control import RunControl
from spmd_rl.runtime.distributed import Peer, Runtime
from spmd_rl.runtime.launch import LaunchInfo

# -------------------------------------------------------------------------------------------------------------------
# PPO and its ActorCritic (tests/ranks/test_ppo.py)

CARTPOLE_OBS = gym.spaces.Box(-np.inf, np.inf, (4,), np.float32)
PENDULUM_ACTIONS = gym.spaces.Box(-2.0, 2.0, (2,), np.float32)


def actor_critic_cfg(**changes) -> ActorCriticConfig:
    return dataclasses.replace(ActorCriticConfig(), **changes)


def act(policy, obs):
    with torch.no_grad():  # as every caller of act() does (the API's promise)
        out = policy.act(obs)
    return out["action"], out["log_prob"], out["value"]


def algo_cfg(**changes) -> PPOConfig:
    return dataclasses.replace(PPOConfig(), **changes)


def make_ppo(policy, cfg, num_iterations, group=None) -> PPO:
    return PPO(
        policy,
        cfg,
        Context.local(policy.observation_space, policy.action_space, num_iterations=num_iterations, group=group),
    )


def rollout_batch(policy: ActorCritic, size: int = 64, seed: int = 0) -> TensorDict:
    """A batch acted by the policy itself (so ratio starts at 1) with random advantages, some steps invalid."""
    generator = torch.Generator().manual_seed(seed)
    obs = torch.randn(size, 4, generator=generator)
    action, log_prob, value = act(policy, obs)
    advantage = torch.randn(size, generator=generator)
    valid = torch.rand(size, generator=generator) > 0.2
    return TensorDict(
        obs=obs,
        action=action,
        log_prob=log_prob,
        value=value,
        advantage=advantage,
        return_=value + advantage,
        valid=valid,
        batch_size=[size],
    )


# -------------------------------------------------------------------------------------------------------------------
# SAC and its squashed Gaussian actor (tests/ranks/test_sac.py)

SAC_OBS = gym.spaces.Box(-np.inf, np.inf, (3,), np.float32)
SAC_ACTIONS = gym.spaces.Box(np.array([-2.0, 0.0], np.float32), np.array([1.0, 10.0], np.float32))  # asymmetric bounds


@pytest.fixture(autouse=True)
def one_torch_thread():
    # Two intra-op threads on a shared 2-core machine spin against each other: one update took 200 ms, not 3 ms.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def squashed_gaussian_cfg(**changes) -> SquashedGaussianConfig:
    return dataclasses.replace(SquashedGaussianConfig(hidden_sizes=[32, 32], activation="relu"), **changes)


def sac_cfg(**changes) -> SACConfig:
    return dataclasses.replace(SACConfig(critic_hidden_sizes=[32, 32], critic_activation="relu"), **changes)


def replay_batch(size: int = 64, seed: int = 0, terminated_fraction: float = 0.2) -> TensorDict:
    generator = torch.Generator().manual_seed(seed)
    low, high = torch.as_tensor(SAC_ACTIONS.low), torch.as_tensor(SAC_ACTIONS.high)
    action = low + (high - low) * torch.rand(size, 2, generator=generator)
    obs = torch.randn(size, 3, generator=generator)
    return TensorDict(
        obs=obs,
        action=action,
        reward=obs[:, 0] - 0.1 * action[:, 0].square(),
        next_obs=torch.randn(size, 3, generator=generator),
        terminated=torch.rand(size, generator=generator) < terminated_fraction,
        batch_size=[size],
    )


def random_transitions(actions: gym.spaces.Box, size: int, seed: int, terminated_fraction: float) -> TensorDict:
    """size transitions of 3-feature observations, uniform actions within `actions`' bounds, random rewards."""
    generator = torch.Generator().manual_seed(seed)
    low, high = torch.as_tensor(actions.low), torch.as_tensor(actions.high)
    return TensorDict(
        obs=torch.randn(size, 3, generator=generator),
        action=low + (high - low) * torch.rand(size, actions.shape[0], generator=generator),
        reward=torch.randn(size, generator=generator),
        next_obs=torch.randn(size, 3, generator=generator),
        terminated=torch.rand(size, generator=generator) < terminated_fraction,
        batch_size=[size],
    )


# -------------------------------------------------------------------------------------------------------------------
# Recurrent PPO on a small CartPole (tests/launchers/test_recurrent.py), as a config mapping

SMALL_CARTPOLE = {
    "env": {"id": "CartPole-v1", "num_envs": 3},
    "algo": {"num_steps": 8},
    "train": {"total_steps": 96},
    "log": {"progress": False, "tensorboard": False},
}
RECURRENT_TINY = {
    **SMALL_CARTPOLE,
    "algo": {
        "class": "spmd_rl.algorithms.recurrent_ppo:RecurrentPPO",
        "num_steps": 16,
        "update_epochs": 2,
        "num_minibatches": 2,
    },
    "policy": {"recurrent_size": 8, "hidden_sizes": [8]},
    "train": {"total_steps": 16 * 3 * 4},
}


# -------------------------------------------------------------------------------------------------------------------
# Observations as a Dict (tests/runs/test_evaluate.py)


class DictObservations(gym.ObservationWrapper):
    """CartPole with its observation split into a Dict: position and velocity parts."""

    def __init__(self, env):
        super().__init__(env)
        box = lambda: gym.spaces.Box(-np.inf, np.inf, (2,), np.float32)  # noqa: E731
        self.observation_space = gym.spaces.Dict({"position": box(), "velocity": box()})

    def observation(self, obs):
        return {"position": obs[[0, 2]], "velocity": obs[[1, 3]]}


# -------------------------------------------------------------------------------------------------------------------
# A forked rank's Runtime (tests/ranks/test_agreement.py) and RunControl's loop (tests/ranks/test_run_control.py)


def gloo_runtime(rank: int, world_size: int) -> Runtime:
    launch = LaunchInfo("test", rank, world_size, rank, world_size, "")
    return Runtime(launch, torch.device("cpu"), "gloo", datetime.timedelta(seconds=20))


def run_iterations(control: RunControl, iterations: range) -> list[int]:
    """Call after_iteration for each iteration; the iterations whose state was captured (checkpointed)."""
    captured = []

    def capture_at(iteration: int):
        def capture() -> dict:
            captured.append(iteration)
            return {"payload": torch.tensor([float(iteration)]), "rank": control.rank}

        return capture

    for iteration in iterations:
        control.after_iteration(iteration, capture_at(iteration))
    return captured


class FrozenEncoderNet(nn.Module):
    """A frozen 'pretrained' encoder, a trainable head and a float64 buffer: the three kinds of tensor a weight sync
    moves (head_width and outputs: an output of 1 row shards unevenly over 3 trainers)."""

    def __init__(self, head_width: int = 16, outputs: int = 3):
        super().__init__()
        torch.manual_seed(0)
        self.encoder = nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 32)).requires_grad_(False)
        self.head = nn.Sequential(nn.Linear(32, head_width), nn.Tanh(), nn.Linear(head_width, outputs))
        self.register_buffer("count", torch.zeros((), dtype=torch.float64))

    def forward(self, x):
        return self.head(self.encoder(x))


def learn_and_publish(net: FrozenEncoderNet, optimizer, source, rank: int, version: int) -> None:
    """One update of a sharded net on this trainer's own random inputs, then its weights as `version` through
    source (a trainer's side of a weight sync)."""
    torch.manual_seed(version + rank)
    net(torch.randn(5, 6)).square().sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    net.count += 1
    source.broadcast(version)


def save_full_weights(net: nn.Module, rank: int, file: str) -> None:
    """The sharded net's whole weights (gathered: every trainer calls it), saved by trainer rank 0 to file."""
    from spmd_rl.comm import sharding

    full = sharding.full_state_dict(net)
    if rank == 0:
        torch.save({k: v.clone() for k, v in full.items()}, file)


def receiving_weight_sync(timeout_s: float) -> SimpleNamespace:
    """The fields of an inference rank's WeightSync that staging reads (rank 1, one 64-byte bucket from rank 0),
    without a process group: for the staged weights' and the async server's own logic."""
    return SimpleNamespace(
        src=0,
        me=1,
        buckets=[torch.zeros(64, dtype=torch.uint8)],
        describe_rank=lambda rank: f"rank {rank}",
        broadcast_peer=lambda: Peer("rank 0", (0,)),
        timeout=datetime.timedelta(seconds=timeout_s),
    )
