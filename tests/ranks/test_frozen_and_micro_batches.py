"""Frozen parameters (requires_grad False: no gradient, no optimizer state) and `algo.micro_batch_size` (a step's
forward and backward in parts, gradients accumulated: the same gradients as the whole minibatch) for PPO,
recurrent PPO and SAC."""

from __future__ import annotations

import copy
import dataclasses
import functools

import gymnasium as gym
import pytest
import torch
import torch.distributed as dist
from harness.multiproc import assert_all_ok, run_ranks
from harness.parts import (
    CARTPOLE_OBS,
    PENDULUM_ACTIONS,
    RECURRENT_TINY,
    algo_cfg,
    make_ppo,
    one_torch_thread,  # noqa: F401 (an autouse fixture: one torch thread, as in test_sac)
    replay_batch,
    rollout_batch,
    sac_cfg,
)
from harness.parts import SAC_ACTIONS as ACTIONS
from harness.parts import SAC_OBS as OBS
from harness.parts import actor_critic_cfg as model_cfg
from harness.parts import squashed_gaussian_cfg as sac_model_cfg
from harness.runs import TINY
from tensordict import TensorDict
from torch import nn

import spmd_rl
from spmd_rl.algorithms.ppo import LOSS_NAMES, PPO, loss_coefficients, minibatch_weights, ppo_losses, rollout_tensors
from spmd_rl.algorithms.ppo import total_loss as ppo_total_loss
from spmd_rl.algorithms.recurrent_ppo import RecurrentPPO, RecurrentPPOConfig
from spmd_rl.algorithms.sac import SAC
from spmd_rl.api import Context
from spmd_rl.interfaces.policy import initial_state
from spmd_rl.modules.actor_critic import ActorCritic
from spmd_rl.modules.recurrent import RecurrentActorCritic, RecurrentActorCriticConfig
from spmd_rl.modules.sac_td3_networks import SquashedGaussianActor

# -- policies with a frozen submodule ----------------------------------------------------------------------------


class FrozenProjection(nn.Module):
    """A "pretrained" projection in front of an encoder, frozen."""

    def __init__(self, encoder: nn.Module):
        super().__init__()
        self.inner = encoder
        self.out_features = encoder.out_features
        self.pretrained = nn.Linear(encoder.out_features, encoder.out_features).requires_grad_(False)

    def forward(self, obs):
        return torch.tanh(self.pretrained(self.inner(obs)))

    def update_normalizer(self, obs, context) -> None:
        self.inner.update_normalizer(obs, context)


class FrozenEncoderActorCritic(ActorCritic):
    def __init__(self, observation_space, action_space, config):
        super().__init__(observation_space, action_space, config)
        self.encoder = FrozenProjection(self.encoder)


class FrozenTrunkActor(SquashedGaussianActor):
    def __init__(self, observation_space, action_space, config):
        super().__init__(observation_space, action_space, config)
        self.net[0].requires_grad_(False)


class FrozenCellsRecurrent(RecurrentActorCritic):
    def __init__(self, observation_space, action_space, config):
        super().__init__(observation_space, action_space, config)
        self.cells.requires_grad_(False)


def frozen_and_trainable(module: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    params = list(module.parameters())
    frozen = [p for p in params if not p.requires_grad]
    assert frozen and len(frozen) < len(params)
    return frozen, [p for p in params if p.requires_grad]


def assert_frozen_after_update(module: nn.Module, optimizer: torch.optim.Optimizer, update) -> None:
    frozen, trainable = frozen_and_trainable(module)
    before = [p.detach().clone() for p in module.parameters()]
    update()
    after = list(module.parameters())
    assert all(torch.equal(b, a) for b, a, p in zip(before, after, module.parameters()) if not p.requires_grad)
    assert any(not torch.equal(b, a) for b, a, p in zip(before, after, module.parameters()) if p.requires_grad)
    in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert not in_optimizer & {id(p) for p in frozen}  # no parameter group holds them ...
    assert {id(p) for p in optimizer.state} == {id(p) for p in trainable}  # ... and no state: every other has
    assert all(p.grad is None for p in frozen)


def test_ppo_leaves_frozen_parameters_alone_and_out_of_its_optimizer():
    torch.manual_seed(0)
    policy = FrozenEncoderActorCritic(CARTPOLE_OBS, gym.spaces.Discrete(2), model_cfg())
    ppo = make_ppo(policy, algo_cfg(update_epochs=2), num_iterations=10)
    assert_frozen_after_update(policy, ppo.optimizer, lambda: ppo.update(rollout_batch(policy), iteration=0))


def test_sac_leaves_frozen_actor_parameters_alone_and_out_of_its_optimizer():
    torch.manual_seed(0)
    actor = FrozenTrunkActor(OBS, ACTIONS, sac_model_cfg())
    sac = SAC(actor, sac_cfg(policy_frequency=1), Context.local(OBS, ACTIONS))
    assert_frozen_after_update(actor, sac.actor_optimizer, lambda: sac.update(replay_batch()))


def recurrent_update_inputs(policy: RecurrentActorCritic, steps: int = 6, envs: int = 5, seed: int = 0):
    """(batch [T, N] as RecurrentPPO.update reads it, episode starts, first state): sequences acted by the policy,
    with random advantages and some reset steps."""
    generator = torch.Generator().manual_seed(seed)
    obs = torch.randn(steps, envs, 4, generator=generator)
    starts = torch.rand(steps, envs, generator=generator) < 0.2
    first = initial_state(policy.recurrent_state(), envs)
    state, actions, log_probs, values = dict(first), [], [], []
    with torch.no_grad():
        for t in range(steps):
            init = initial_state(policy.recurrent_state(), envs)
            state = {k: torch.where(starts[t].unsqueeze(-1), init[k], v) for k, v in state.items()}
            out, state = policy.act(obs[t], state=state)
            actions.append(out["action"]), log_probs.append(out["log_prob"]), values.append(out["value"])
    advantage = torch.randn(steps, envs, generator=generator)
    value = torch.stack(values)
    batch = TensorDict(
        obs=obs,
        action=torch.stack(actions),
        log_prob=torch.stack(log_probs) + 0.3 * torch.randn(steps, envs, generator=generator),  # ratios != 1
        value=value,
        advantage=advantage,
        return_=value + advantage,
        valid=torch.rand(steps, envs, generator=generator) > 0.2,
        batch_size=[steps, envs],
    )
    return batch, starts, first


def recurrent_ppo(policy, **changes) -> RecurrentPPO:
    cfg = dataclasses.replace(RecurrentPPOConfig(), **changes)
    return RecurrentPPO(policy, cfg, Context.local(CARTPOLE_OBS, gym.spaces.Discrete(2), num_iterations=10))


def recurrent_policy(cls=RecurrentActorCritic) -> RecurrentActorCritic:
    torch.manual_seed(0)
    return cls(CARTPOLE_OBS, gym.spaces.Discrete(2), RecurrentActorCriticConfig(recurrent_size=8, hidden_sizes=[8]))


def test_recurrent_ppo_leaves_frozen_parameters_alone_and_out_of_its_optimizer():
    policy = recurrent_policy(FrozenCellsRecurrent)
    algorithm = recurrent_ppo(policy, update_epochs=2)
    batch, starts, first = recurrent_update_inputs(policy)
    assert_frozen_after_update(policy, algorithm.optimizer, lambda: algorithm.update(batch, starts, first, 0))


# -- micro-batches: the whole minibatch's gradients --------------------------------------------------------------


def grads_of(module: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in module.parameters() if p.grad is not None]


def assert_same_gradients(parts: list[torch.Tensor], whole: list[torch.Tensor]) -> None:
    assert len(parts) == len(whole) > 0
    for a, b in zip(parts, whole):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_ppo_micro_batches_give_the_whole_minibatchs_gradients_and_diagnostics():
    torch.manual_seed(0)
    policy = ActorCritic(CARTPOLE_OBS, PENDULUM_ACTIONS, model_cfg())
    cfg = algo_cfg(micro_batch_size=24, ent_coef=0.01, clip_value_loss=True)  # parts of 24, 24 and 16
    ppo = make_ppo(policy, cfg, num_iterations=10)
    batch = rollout_batch(policy)
    batch["log_prob"] += 0.3 * torch.randn(64)  # ratios away from 1: some entries clipped
    data = rollout_tensors(batch)
    share, advantage = minibatch_weights(data["valid"], data["advantage"], cfg.normalize_advantages)
    coefficients = loss_coefficients(cfg)

    in_parts = ppo.gradients_in_parts(data, share, advantage, 0.2, coefficients)
    parts_grads = grads_of(policy)
    policy.zero_grad(set_to_none=True)
    whole = ppo_losses(data, *policy(data["obs"], data["action"]), 0.2, cfg)  # the path without parts
    ppo_total_loss(whole, cfg).backward()
    assert_same_gradients(parts_grads, grads_of(policy))
    torch.testing.assert_close(in_parts, torch.stack([whole[name] for name in LOSS_NAMES]).detach())
    assert 0 < float(whole["clip_fraction"].detach()) < 1

    # A whole update: the same steps and the same diagnostics as without parts.
    twin = copy.deepcopy(policy)
    plain = make_ppo(twin, dataclasses.replace(cfg, micro_batch_size=0), num_iterations=10)
    torch.manual_seed(1)
    with_parts = ppo.update(batch, iteration=0)
    torch.manual_seed(1)
    without = plain.update(batch, iteration=0)
    assert with_parts.keys() == without.keys() and with_parts["minibatch_steps"] == without["minibatch_steps"]
    for name in LOSS_NAMES:
        assert abs(with_parts[name] - without[name]) < 1e-5, name
    for a, b in zip(policy.parameters(), twin.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_recurrent_ppo_micro_batches_of_sequences_give_the_whole_minibatchs_gradients():
    policy = recurrent_policy()
    algorithm = recurrent_ppo(policy, micro_batch_size=2, ent_coef=0.01)  # 5 sequences: parts of 2, 2 and 1
    batch, starts, first = recurrent_update_inputs(policy)
    data = rollout_tensors(batch)
    cols = torch.tensor([4, 0, 3, 1, 2])
    algorithm.first_ratio = None
    in_parts = algorithm.gradients_in_parts(data, starts, first, cols, 0.2)
    parts_grads, parts_ratio = grads_of(policy), algorithm.first_ratio
    policy.zero_grad(set_to_none=True)
    sequence = {key: value[:, cols] for key, value in data.items()}
    log_prob, entropy, value = policy(
        sequence["obs"], sequence["action"], starts[:, cols], {k: v[cols] for k, v in first.items()}
    )
    flat = {key: v.reshape(-1) for key, v in sequence.items() if key not in ("obs", "action")}
    whole = ppo_losses(flat, log_prob.reshape(-1), entropy.reshape(-1), value.reshape(-1), 0.2, algorithm.cfg)
    ppo_total_loss(whole, algorithm.cfg).backward()
    assert_same_gradients(parts_grads, grads_of(policy))
    torch.testing.assert_close(in_parts, torch.stack([whole[name] for name in LOSS_NAMES]).detach())
    ratio = ((log_prob.reshape(-1) - flat["log_prob"]).exp() - 1).abs() * flat["valid"]
    assert abs(parts_ratio - float(ratio.max())) < 1e-6


def test_sac_micro_batches_give_the_whole_batchs_gradients():
    def sac(micro_batch_size: int) -> SAC:
        torch.manual_seed(0)
        actor = SquashedGaussianActor(OBS, ACTIONS, sac_model_cfg())
        return SAC(actor, sac_cfg(policy_frequency=1, micro_batch_size=micro_batch_size), Context.local(OBS, ACTIONS))

    whole, in_parts = sac(0), sac(16)  # 64 rows: 4 parts, each 32 noise numbers (the same draws as the whole's)
    batch = replay_batch(64)
    torch.manual_seed(1)
    whole_metrics = whole.update(batch)
    torch.manual_seed(1)
    parts_metrics = in_parts.update(batch)
    assert whole_metrics.keys() == parts_metrics.keys() >= {"qf_loss", "q1_mean", "actor_loss", "alpha_loss"}
    for name, value in whole_metrics.items():
        assert abs(parts_metrics[name] - value) < 1e-5, name
    # the gradients each step applied (left in .grad): critics, actor and temperature
    for a, b in ((whole.critic, in_parts.critic), (whole.actor, in_parts.actor)):
        assert_same_gradients(grads_of(b), grads_of(a))
    torch.testing.assert_close(in_parts.log_alpha.grad, whole.log_alpha.grad, rtol=0, atol=1e-6)


def _ddp_micro_batches(rank: int, world_size: int) -> None:
    torch.manual_seed(rank)
    policy = ActorCritic(CARTPOLE_OBS, gym.spaces.Discrete(2), model_cfg())
    ppo = make_ppo(policy, algo_cfg(micro_batch_size=10), num_iterations=10, group=dist.group.WORLD)
    reference = copy.deepcopy(policy)  # rank 0's weights (DDP broadcast them), outside DDP
    batch = rollout_batch(policy, size=32 + 8 * rank, seed=rank)
    data = rollout_tensors(batch)
    share, advantage = minibatch_weights(data["valid"], data["advantage"], True)
    ppo.gradients_in_parts(data, share, advantage, 0.2, loss_coefficients(ppo.cfg))  # DDP, no_sync but the last
    # the trainers' mean of each one's whole-minibatch gradients
    ppo_total_loss(ppo_losses(data, *reference(data["obs"], data["action"]), 0.2, ppo.cfg), ppo.cfg).backward()
    expected = [g / world_size for g in grads_of(reference)]
    for grad in expected:
        dist.all_reduce(grad)
    assert_same_gradients(grads_of(policy), expected)


def test_ddp_micro_batches_average_the_accumulated_gradients_once():
    assert_all_ok(run_ranks(_ddp_micro_batches, 2, timeout_s=30))


def _fsdp_micro_batches(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    base = FrozenEncoderActorCritic(CARTPOLE_OBS, gym.spaces.Discrete(2), model_cfg())
    context = dataclasses.replace(
        Context.local(CARTPOLE_OBS, gym.spaces.Discrete(2), num_iterations=10, group=dist.group.WORLD),
        parallel="fsdp",
        policy_methods=("act", "evaluate", "value", "forward"),
    )
    batch = rollout_batch(base, size=32 + 8 * rank, seed=rank)
    results = []
    for micro_batch_size in (0, 10):  # FSDP2: gradient sync off for all parts but the last
        policy = copy.deepcopy(base)
        ppo = PPO(policy, algo_cfg(update_epochs=2, micro_batch_size=micro_batch_size), context)
        torch.manual_seed(1)
        assert_frozen_after_update(policy, ppo.optimizer, functools.partial(ppo.update, batch, iteration=0))
        results.append(torch.cat([p.full_tensor().detach().reshape(-1) for p in policy.parameters()]))
    torch.testing.assert_close(results[1], results[0], rtol=0, atol=1e-5)


def test_fsdp_micro_batches_and_frozen_parameters_give_the_same_update():
    assert_all_ok(run_ranks(_fsdp_micro_batches, 2, timeout_s=60))


def test_a_short_run_with_micro_batches_completes(tmp_path):
    ppo = spmd_rl.train(TINY, {"run.dir": tmp_path / "ppo", "algo.micro_batch_size": 12})  # batch 32: 12, 12, 8
    assert ppo.finished and ppo.metrics["minibatch_steps"] == 2


@pytest.mark.slow
def test_short_recurrent_and_sac_runs_with_micro_batches_complete(tmp_path):
    recurrent = spmd_rl.train(RECURRENT_TINY, {"run.dir": str(tmp_path / "recurrent"), "algo.micro_batch_size": 1})
    assert recurrent.finished and recurrent.metrics["minibatch_steps"] == 4
    sac = spmd_rl.train(
        None,
        {
            "run.dir": tmp_path / "sac",
            "env.id": "Pendulum-v1",
            "env.num_envs": 2,
            "algo.class": "sac",
            "algo.num_steps": 16,
            "algo.batch_size": 32,
            "algo.learning_starts": 32,
            "algo.micro_batch_size": 8,
            "train.total_steps": 96,
            "log.progress": False,
            "log.tensorboard": False,
        },
    )
    assert sac.finished and "qf_loss" in sac.metrics and "actor_loss" in sac.metrics
