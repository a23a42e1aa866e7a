"""PPO math (GAE, losses, update, schedules) and the ActorCritic policy it trains."""

from __future__ import annotations

import copy

import gymnasium as gym
import numpy as np
import pytest
import torch
import torch.distributed as dist
from harness.multiproc import assert_all_ok, run_ranks
from harness.parts import CARTPOLE_OBS, PENDULUM_ACTIONS, act, algo_cfg, make_ppo, rollout_batch
from harness.parts import actor_critic_cfg as model_cfg
from tensordict import TensorDict

from spmd_rl.algorithms.configs import PPOConfig
from spmd_rl.algorithms.ppo import compute_gae, ppo_losses, rollout_tensors, total_loss
from spmd_rl.api import StepField
from spmd_rl.modules.actor_critic import ActorCritic
from spmd_rl.runtime.errors import UserError

# ---------------------------------------------------------------------------------------------------------------
# GAE


def test_gae_matches_hand_computed_values_with_truncation_termination_and_resets():
    gamma, lam = 0.5, 0.5  # gamma * lam = 0.25
    # Env 0: t=1 is truncated (so the obs recorded at t=2 is the final obs, V = 4) and t=2 is its reset step;
    # t=3 is terminated and t=4 its reset step. Env 1 never ends: r = 1, V = 0 throughout.
    rewards = torch.tensor([[1.0, 1.0], [1.0, 1.0], [0.0, 1.0], [1.0, 1.0], [0.0, 1.0]])
    values = torch.tensor([[1.0, 0.0], [2.0, 0.0], [4.0, 0.0], [3.0, 0.0], [5.0, 0.0]])
    next_value = torch.tensor([6.0, 0.0])
    terminated = torch.tensor([[0, 0], [0, 0], [0, 0], [1, 0], [0, 0]], dtype=torch.bool)
    truncated = torch.tensor([[0, 0], [1, 0], [0, 0], [0, 0], [0, 0]], dtype=torch.bool)

    advantages, returns = compute_gae(rewards, values, next_value, terminated, truncated, gamma, lam)

    # Env 0, from the end:
    #   t=4 (reset step): delta = 0 + 0.5 * 6 - 5 = -2                           A = -2
    #   t=3 (terminated): delta = 1 + 0 (no bootstrap) - 3 = -2                  A = -2 (chain cut: done)
    #   t=2 (reset step): delta = 0 + 0.5 * 3 - 4 = -2.5                         A = -2.5 + 0.25 * -2 = -3
    #   t=1 (truncated):  delta = 1 + 0.5 * 4 (final obs value) - 2 = 1         A = 1 (chain cut: done)
    #   t=0:              delta = 1 + 0.5 * 2 - 1 = 1                            A = 1 + 0.25 * 1 = 1.25
    # Env 1: delta = 1 everywhere, A_t = 1 + 0.25 * A_{t+1}.
    expected = torch.tensor([[1.25, 1.33203125], [1.0, 1.328125], [-3.0, 1.3125], [-2.0, 1.25], [-2.0, 1.0]])
    torch.testing.assert_close(advantages, expected)
    torch.testing.assert_close(returns, expected + values)
    assert advantages.dtype == returns.dtype == torch.float32


# ---------------------------------------------------------------------------------------------------------------
# ActorCritic


def test_discrete_policy_shapes_dtypes_and_consistent_log_probs():
    torch.manual_seed(0)
    policy = ActorCritic(CARTPOLE_OBS, gym.spaces.Discrete(3), model_cfg())
    assert policy.outputs()["action"] == StepField((), torch.int64)
    obs = torch.randn(5, 4)
    action, log_prob, value = act(policy, obs)
    assert action.shape == (5,) and action.dtype == torch.int64
    assert log_prob.shape == value.shape == (5,) and log_prob.dtype == value.dtype == torch.float32
    assert ((action >= 0) & (action < 3)).all()
    new_log_prob, entropy, new_value = policy.evaluate(obs, action)
    torch.testing.assert_close(new_log_prob, log_prob)
    torch.testing.assert_close(new_value, value)
    torch.testing.assert_close(policy.value(obs), value)
    # The 0.01-gain policy head starts near uniform.
    torch.testing.assert_close(entropy, torch.full((5,), float(np.log(3))), atol=1e-3, rtol=0)
    assert new_log_prob.requires_grad


def test_continuous_policy_matches_a_diagonal_gaussian():
    torch.manual_seed(0)
    policy = ActorCritic(CARTPOLE_OBS, PENDULUM_ACTIONS, model_cfg(log_std_init=-0.5, activation="elu"))
    assert policy.outputs()["action"] == StepField((2,), torch.float32)
    obs = torch.randn(6, 4)
    action, log_prob, value = act(policy, obs)
    assert action.shape == (6, 2) and action.dtype == torch.float32
    assert log_prob.shape == value.shape == (6,)
    new_log_prob, entropy, _ = policy(obs, action)  # forward() is evaluate(), for DDP
    reference = torch.distributions.Normal(policy.actor(obs), torch.full((2,), -0.5).exp())
    torch.testing.assert_close(new_log_prob, reference.log_prob(action).sum(-1))
    torch.testing.assert_close(log_prob, new_log_prob.detach())
    torch.testing.assert_close(entropy, reference.entropy().sum(-1))


def test_policy_normalizes_observations_with_its_normalizer():
    policy = ActorCritic(CARTPOLE_OBS, gym.spaces.Discrete(2), model_cfg(normalize_obs=True))
    obs = torch.randn(8, 4) * 50 + 300
    policy.encoder.normalizer.update(obs)
    expected = policy.critic((obs - obs.mean(0)) / obs.std(0, unbiased=False)).squeeze(-1)
    torch.testing.assert_close(policy.value(obs), expected, atol=1e-4, rtol=1e-4)
    assert "encoder.normalizer.mean" in policy.state_dict()


@pytest.mark.parametrize(
    "obs_space, action_space, named",
    [
        (gym.spaces.Tuple([CARTPOLE_OBS]), gym.spaces.Discrete(2), "Tuple"),
        (CARTPOLE_OBS, gym.spaces.MultiDiscrete([2, 3]), "MultiDiscrete"),
        (CARTPOLE_OBS, gym.spaces.Box(-1, 1, (), np.float32), "Box(-1.0, 1.0, ()"),  # N-D Boxes are (chunks)
        (CARTPOLE_OBS, gym.spaces.Discrete(3, start=1), "Discrete(3, start=1)"),
    ],
)
def test_unsupported_spaces_are_user_errors_naming_the_space(obs_space, action_space, named):
    with pytest.raises(UserError, match="supported") as error:
        ActorCritic(obs_space, action_space, model_cfg())
    assert named in str(error.value)


# ---------------------------------------------------------------------------------------------------------------
# PPO update


def test_first_minibatch_has_ratio_one_and_no_clipping():
    torch.manual_seed(0)
    policy = ActorCritic(CARTPOLE_OBS, gym.spaces.Discrete(2), model_cfg())
    ppo = make_ppo(policy, algo_cfg(update_epochs=1, num_minibatches=1), num_iterations=10)
    metrics = ppo.update(rollout_batch(policy), iteration=0)
    assert metrics["minibatch_steps"] == 1
    assert metrics["clip_fraction"] == 0.0
    assert abs(metrics["approx_kl"]) < 1e-7


def masked_loss_gradients(policy: ActorCritic, batch: TensorDict, cfg: PPOConfig) -> list[torch.Tensor]:
    data = rollout_tensors(batch)
    losses = ppo_losses(data, *policy.evaluate(data["obs"], data["action"]), clip=0.2, cfg=cfg)
    policy.zero_grad()
    total_loss(losses, cfg).backward()
    return [total_loss(losses, cfg).detach()] + [p.grad.clone() for p in policy.parameters()]


@pytest.mark.parametrize("clip_value_loss", [False, True])
def test_invalid_entries_do_not_change_loss_or_gradients(clip_value_loss):
    torch.manual_seed(0)
    policy = ActorCritic(CARTPOLE_OBS, PENDULUM_ACTIONS, model_cfg())
    cfg = algo_cfg(ent_coef=0.01, clip_value_loss=clip_value_loss)
    batch = rollout_batch(policy)
    garbage = batch.clone()
    invalid = ~batch["valid"]
    count = int(invalid.sum())
    garbage["obs"][invalid] = torch.randn(count, 4) * 100
    garbage["action"][invalid] = torch.randn(count, 2) * 100
    garbage["log_prob"][invalid] = -torch.inf  # a ratio of inf, which a mask alone would turn into NaN gradients
    garbage["advantage"][invalid] = 1e6
    garbage["return_"][invalid] = torch.nan
    garbage["value"][invalid] = -1e6
    for clean, dirty in zip(masked_loss_gradients(policy, batch, cfg), masked_loss_gradients(policy, garbage, cfg)):
        torch.testing.assert_close(dirty, clean)


def test_update_on_a_fixed_batch_lowers_the_loss():
    torch.manual_seed(0)
    policy = ActorCritic(CARTPOLE_OBS, gym.spaces.Discrete(2), model_cfg())
    cfg = algo_cfg(update_epochs=10, num_minibatches=2, anneal_lr=False, anneal_clip=False)
    batch = rollout_batch(policy)
    data = rollout_tensors(batch)

    def loss() -> float:
        with torch.no_grad():
            return float(total_loss(ppo_losses(data, *policy.evaluate(data["obs"], data["action"]), 0.2, cfg), cfg))

    before = loss()
    metrics = make_ppo(policy, cfg, num_iterations=10).update(batch, iteration=0)
    assert metrics["minibatch_steps"] == 20
    assert loss() < before - 0.1


def test_learning_rate_and_clip_anneal_linearly_from_the_configured_values():
    policy = ActorCritic(CARTPOLE_OBS, gym.spaces.Discrete(2), model_cfg())
    ppo = make_ppo(policy, algo_cfg(learning_rate=1e-3, clip_coef=0.2, update_epochs=1), num_iterations=4)
    assert ppo.annealed(0) == (1e-3, 0.2)
    assert ppo.annealed(2) == pytest.approx((5e-4, 0.1))
    assert ppo.annealed(3) == pytest.approx((2.5e-4, 0.05))
    metrics = ppo.update(rollout_batch(policy), iteration=1)
    assert metrics["learning_rate"] == pytest.approx(7.5e-4)
    assert metrics["clip_coef"] == pytest.approx(0.15)
    assert ppo.optimizer.param_groups[0]["lr"] == pytest.approx(7.5e-4)
    constant = make_ppo(policy, algo_cfg(anneal_lr=False, anneal_clip=False), num_iterations=4)
    assert constant.annealed(3) == (1e-3, 0.2)


def test_target_kl_stops_the_update_before_stepping_too_far():
    torch.manual_seed(0)
    policy = ActorCritic(CARTPOLE_OBS, gym.spaces.Discrete(2), model_cfg())
    ppo = make_ppo(policy, algo_cfg(update_epochs=10, num_minibatches=4, target_kl=1e-6), num_iterations=10)
    metrics = ppo.update(rollout_batch(policy), iteration=0)
    # The first minibatch has ratio 1 (kl 0) and steps; the policy has moved by the second one.
    assert metrics["minibatch_steps"] == 1


def _ddp_update(rank: int, world_size: int) -> None:
    torch.manual_seed(rank)  # different initial weights per rank: DDP must broadcast rank 0's
    policy = ActorCritic(CARTPOLE_OBS, gym.spaces.Discrete(2), model_cfg())
    cfg = algo_cfg(update_epochs=3, num_minibatches=2, target_kl=1e-6)
    ppo = make_ppo(policy, cfg, num_iterations=10, group=dist.group.WORLD)  # the context wraps it in DDP
    batch = rollout_batch(policy, size=32 + 8 * rank, seed=rank)  # each trainer its own share of the batch
    steps = [ppo.update(batch, iteration)["minibatch_steps"] for iteration in range(2)]
    # The group agrees on the early stop: every rank took the same steps, so the weights stayed identical.
    # (The second update stops before its first step: a forward without backward must not upset DDP.)
    assert steps == [1.0, 0.0], steps
    flat = torch.cat([p.detach().reshape(-1) for p in policy.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(gathered, flat)
    for other in gathered[1:]:
        torch.testing.assert_close(other, gathered[0], rtol=0, atol=0)
    assert not torch.equal(flat, torch.cat([p.detach().reshape(-1) for p in initial_weights()]))


def initial_weights() -> list[torch.Tensor]:
    torch.manual_seed(0)  # rank 0's initial weights, which DDP broadcast to everyone
    return list(ActorCritic(CARTPOLE_OBS, gym.spaces.Discrete(2), model_cfg()).parameters())


def test_ddp_update_keeps_trainers_identical_and_agrees_on_early_stop():
    assert_all_ok(run_ranks(_ddp_update, 2, timeout_s=30))


def test_optimizer_state_round_trips():
    torch.manual_seed(0)
    policy = ActorCritic(CARTPOLE_OBS, gym.spaces.Discrete(2), model_cfg())
    ppo = make_ppo(policy, algo_cfg(update_epochs=1), num_iterations=10)
    ppo.update(rollout_batch(policy), iteration=0)
    restored = make_ppo(copy.deepcopy(policy), algo_cfg(update_epochs=1), num_iterations=10)
    restored.load_state_dict(ppo.state_dict())
    original_state = ppo.optimizer.state_dict()["state"]
    for index, state in restored.optimizer.state_dict()["state"].items():
        torch.testing.assert_close(state["exp_avg"], original_state[index]["exp_avg"])


@pytest.mark.parametrize(
    "obs_space, encoder",
    [
        (gym.spaces.Box(0, 255, (12, 10, 3), np.uint8), "ImageEncoder"),  # channel-last pixels
        (gym.spaces.Box(0.0, 1.0, (2, 12, 10), np.float32), "ImageEncoder"),  # channel-first floats
        (gym.spaces.Box(-1.0, 1.0, (3, 4), np.float32), "VectorEncoder"),  # a matrix, flattened
        (
            gym.spaces.Dict(
                {
                    "image": gym.spaces.Box(0, 255, (12, 10, 1), np.uint8),
                    "state": gym.spaces.Box(-1.0, 1.0, (5,), np.float32),
                }
            ),
            "DictEncoder",
        ),
    ],
)
def test_the_encoder_is_chosen_from_the_observation_space_and_acts_on_the_env_dtype(obs_space, encoder):
    from spmd_rl.envs.spaces import zeros_of

    torch.manual_seed(0)
    policy = ActorCritic(obs_space, gym.spaces.Discrete(3), model_cfg())
    assert type(policy.encoder).__name__ == encoder
    obs = zeros_of(obs_space, 4)
    out = policy.act(obs)
    assert out["action"].shape == (4,) and out["action"].dtype == torch.int64
    log_prob, entropy, value = policy.evaluate(obs, out["action"])
    torch.testing.assert_close(log_prob, out["log_prob"])
    assert value.shape == (4,)
