"""SAC math (TD target, Polyak, delayed actor updates, learning), its networks, and gradient averaging over ranks."""

from __future__ import annotations

import copy

import gymnasium as gym
import numpy as np
import pytest
import torch
import torch.distributed as dist
from harness.multiproc import assert_all_ok, run_ranks
from harness.parts import SAC_ACTIONS as ACTIONS
from harness.parts import SAC_OBS as OBS
from harness.parts import one_torch_thread, replay_batch, sac_cfg  # noqa: F401 (one_torch_thread: an autouse fixture)
from harness.parts import squashed_gaussian_cfg as model_cfg

from spmd_rl.algorithms.sac import SAC
from spmd_rl.api import Context
from spmd_rl.modules.configs import SquashedGaussianConfig
from spmd_rl.modules.sac_td3_networks import SquashedGaussianActor, TwinQ
from spmd_rl.runtime.errors import UserError


def make_sac(seed: int = 0, model: SquashedGaussianConfig | None = None, group=None, **changes) -> SAC:
    torch.manual_seed(seed)
    actor = SquashedGaussianActor(OBS, ACTIONS, model or model_cfg())
    return SAC(actor, sac_cfg(**changes), Context.local(OBS, ACTIONS, group=group))


def flat_state(sac: SAC) -> torch.Tensor:
    tensors = [*sac.actor_params, *sac.critic_params, *sac.target_params, sac.log_alpha.reshape(1)]
    return torch.cat([t.detach().reshape(-1) for t in tensors])


# ---------------------------------------------------------------------------------------------------------------
# Networks


def test_actions_lie_within_asymmetric_bounds_with_the_declared_shape_and_dtype():
    torch.manual_seed(0)
    actor = SquashedGaussianActor(OBS, ACTIONS, model_cfg())
    assert list(actor.outputs()) == ["action"]
    assert actor.outputs()["action"].shape == (2,) and actor.outputs()["action"].dtype == torch.float32
    action = actor.act(torch.randn(4096, 3) * 10)["action"]  # large inputs: many saturated tanh
    assert action.shape == (4096, 2) and action.dtype == torch.float32 and not action.requires_grad
    low, high = torch.as_tensor(ACTIONS.low), torch.as_tensor(ACTIONS.high)
    assert ((action >= low) & (action <= high)).all()
    # Both ends of each dimension are reached: the squash spans the whole box, not [-1, 1].
    assert (action[:, 1] > 9.0).any() and (action[:, 1] < 1.0).any()
    assert (action[:, 0] < -1.5).any() and (action[:, 0] > 0.5).any()


def test_log_prob_matches_a_tanh_and_affine_transformed_gaussian():
    torch.manual_seed(0)
    actor = SquashedGaussianActor(OBS, ACTIONS, model_cfg(activation="tanh"))
    obs = torch.randn(256, 3)
    action, log_prob = actor.sample(obs)
    assert log_prob.requires_grad
    mean, log_std = (t.detach().double() for t in actor(obs))
    assert (log_std >= -5).all() and (log_std <= 2).all()
    scale, bias = actor.action_scale.double(), actor.action_bias.double()
    reference = torch.distributions.TransformedDistribution(
        torch.distributions.Independent(torch.distributions.Normal(mean, log_std.exp()), 1),
        [torch.distributions.TanhTransform(), torch.distributions.AffineTransform(bias, scale)],
    )
    inside = ((action.double() - bias) / scale).abs().amax(-1) < 0.999  # atanh of a float32 edge is imprecise
    assert inside.sum() > 200
    expected = reference.log_prob(action.detach().double())
    torch.testing.assert_close(log_prob.detach().double()[inside], expected[inside], atol=2e-4, rtol=1e-4)


def test_critics_and_actor_see_the_actors_normalized_observations():
    torch.manual_seed(0)
    model = model_cfg(normalize_obs=True)
    actor = SquashedGaussianActor(OBS, ACTIONS, model)
    obs = torch.randn(64, 3) * 50 + 300
    actor.obs_normalizer.update(obs)
    features = actor.features(obs)
    torch.testing.assert_close(features, (obs - obs.mean(0)) / obs.std(0, unbiased=False), atol=1e-4, rtol=1e-4)
    sac = SAC(actor, sac_cfg(), Context.local(OBS, ACTIONS))
    assert not any("normalizer" in key for key in sac.critic.state_dict())  # one normalizer: the actor's
    batch = replay_batch(64)
    batch["obs"] = obs
    with torch.no_grad():
        normalized_q1 = sac.critic(features, batch["action"])[0].mean().item()
        raw_q1 = sac.critic(obs, batch["action"])[0].mean().item()
    q1_mean = sac.update(batch)["q1_mean"]  # Q of the batch before the step
    assert q1_mean == pytest.approx(normalized_q1, rel=1e-5) and q1_mean != pytest.approx(raw_q1, rel=1e-2)


def test_twin_critics_are_independent_and_output_one_value_per_row():
    torch.manual_seed(0)
    critic = TwinQ(OBS, ACTIONS, [32, 32], "relu")
    q1, q2 = critic(torch.randn(5, 3), torch.randn(5, 2))
    assert q1.shape == q2.shape == (5,)
    assert not torch.equal(q1, q2)


@pytest.mark.parametrize(
    "action_space, named",
    [
        (gym.spaces.Discrete(3), "Discrete(3)"),
        (gym.spaces.MultiDiscrete([2, 3]), "MultiDiscrete"),
    ],
)
def test_non_box_actions_are_user_errors_naming_the_space(action_space, named):
    with pytest.raises(UserError, match=r"SAC needs continuous \(Box\) actions; got") as error:
        SquashedGaussianActor(OBS, action_space, model_cfg())
    assert named in str(error.value)
    with pytest.raises(UserError, match="Box"):
        TwinQ(OBS, action_space, [32, 32], "relu")


@pytest.mark.parametrize(
    "obs_space, action_space, match",
    [
        (OBS, gym.spaces.Box(-np.inf, np.inf, (2,), np.float32), "infinite bounds"),
        (OBS, gym.spaces.Box(-1, 1, (2, 2), np.float32), "1-D Box of actions"),
        (gym.spaces.Box(0, 255, (8, 8, 3), np.uint8), ACTIONS, "observation space"),
    ],
)
def test_unsquashable_spaces_are_user_errors(obs_space, action_space, match):
    with pytest.raises(UserError, match=match):
        SquashedGaussianActor(obs_space, action_space, model_cfg())


def test_autotune_needs_a_positive_initial_temperature():
    with pytest.raises(UserError, match="algo.alpha"):
        make_sac(alpha=0.0, autotune=True)
    assert make_sac(alpha=0.0, autotune=False).update(replay_batch())["alpha"] == 0.0


# ---------------------------------------------------------------------------------------------------------------
# Targets and schedules


def test_td_target_is_the_reward_when_terminated_and_the_soft_bootstrap_otherwise():
    sac = make_sac(gamma=0.9, alpha=0.3, autotune=False)
    reward = torch.tensor([1.0, -2.0, 0.5, 3.0])
    next_obs = torch.randn(4, 3)
    terminated = torch.tensor([True, True, False, False])

    torch.manual_seed(5)
    target = sac.td_target(reward, next_obs, terminated)
    torch.manual_seed(5)  # the same next actions
    next_action, next_log_prob = sac.actor.sample(next_obs)
    q1, q2 = sac.critic_target(next_obs, next_action)
    bootstrap = reward + 0.9 * (torch.min(q1, q2) - 0.3 * next_log_prob)

    assert torch.equal(target[:2], reward[:2])  # exactly the reward: nothing of the next state leaks in
    torch.testing.assert_close(target[2:], bootstrap[2:].detach())
    assert not target.requires_grad
    all_terminated = sac.td_target(reward, torch.full((4, 3), float("nan")), torch.ones(4, dtype=torch.bool))
    assert torch.equal(all_terminated, reward)


def test_polyak_update_moves_targets_tau_of_the_way_and_follows_its_frequency():
    sac = make_sac(tau=0.25, target_network_frequency=2, policy_frequency=100)
    with torch.no_grad():
        for param in sac.target_params:
            param.fill_(1.0)
    assert sac.critic_target.state_dict().keys() == sac.critic.state_dict().keys()
    assert not any(param.requires_grad for param in sac.target_params)

    sac.update(replay_batch())  # call 1: no Polyak step
    assert all(torch.equal(param, torch.ones_like(param)) for param in sac.target_params)
    sac.update(replay_batch(seed=1))  # call 2: one Polyak step from the critics as they are now
    for param, target in zip(sac.critic_params, sac.target_params):
        torch.testing.assert_close(target, 0.25 * param.detach() + 0.75)


def test_actor_and_temperature_take_policy_frequency_steps_every_policy_frequency_calls():
    sac = make_sac(policy_frequency=3)
    actor_before = torch.cat([p.detach().reshape(-1) for p in sac.actor_params])
    alpha_before = sac.alpha.item()
    keys = []
    for call in range(1, 7):
        metrics = sac.update(replay_batch(seed=call))
        keys.append(set(metrics))
        actor_now = torch.cat([p.detach().reshape(-1) for p in sac.actor_params])
        if call < 3:
            assert torch.equal(actor_now, actor_before) and sac.alpha.item() == alpha_before
    critic_only = {"qf1_loss", "qf2_loss", "qf_loss", "q1_mean", "alpha"}
    assert keys == [critic_only, critic_only, critic_only | {"actor_loss", "alpha_loss"}] * 2
    assert sac.alpha.item() != alpha_before and not torch.equal(actor_now, actor_before)
    # Two actor phases of three steps each; the critic stepped on every call.
    assert int(sac.actor_optimizer.state_dict()["state"][0]["step"]) == 6
    assert int(sac.alpha_optimizer.state_dict()["state"][0]["step"]) == 6
    assert int(sac.critic_optimizer.state_dict()["state"][0]["step"]) == 6


def test_actor_step_leaves_the_critics_untouched():
    # The actor's loss backpropagates through the critics; only the critic step may change them.
    with_actor, critic_only = make_sac(policy_frequency=1, autotune=False), make_sac(policy_frequency=100)
    for sac in (with_actor, critic_only):
        torch.manual_seed(3)  # the same next-action noise in the TD target
        metrics = sac.update(replay_batch())
    assert "actor_loss" not in metrics
    assert torch.equal(
        torch.cat([p.detach().reshape(-1) for p in with_actor.critic_params]),
        torch.cat([p.detach().reshape(-1) for p in critic_only.critic_params]),
    )
    assert not torch.equal(
        torch.cat([p.detach().reshape(-1) for p in with_actor.actor_params]),
        torch.cat([p.detach().reshape(-1) for p in critic_only.actor_params]),
    )


# ---------------------------------------------------------------------------------------------------------------
# Learning and checkpoints


def test_updates_on_a_fixed_batch_lower_the_critic_loss():
    sac = make_sac(gamma=0.5)
    batch = replay_batch(128, terminated_fraction=0.5)
    losses = [sac.update(batch)["qf_loss"] for _ in range(300)]
    assert all(np.isfinite(losses))
    assert np.mean(losses[-20:]) < 0.3 * np.mean(losses[:20]), (losses[:20], losses[-20:])


def test_state_round_trips_and_resumes_identically():
    sac = make_sac(policy_frequency=2)
    for seed in range(3):
        sac.update(replay_batch(seed=seed))
    restored = make_sac(seed=1, policy_frequency=2)
    restored.actor.load_state_dict(sac.actor.state_dict())  # the actor is saved with the policy
    restored.load_state_dict(copy.deepcopy(sac.state_dict()))
    assert restored.num_updates == 3
    torch.testing.assert_close(flat_state(restored), flat_state(sac), rtol=0, atol=0)
    torch.manual_seed(9)
    expected = sac.update(replay_batch(seed=7))
    torch.manual_seed(9)
    resumed = restored.update(replay_batch(seed=7))
    assert resumed == expected  # the 4th call takes the actor step in both
    torch.testing.assert_close(flat_state(restored), flat_state(sac), rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------------------------
# Data-parallel trainers


def _all_equal_across_ranks(flat: torch.Tensor, world_size: int) -> bool:
    gathered = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(gathered, flat)
    return all(torch.equal(other, gathered[0]) for other in gathered[1:])


def _averaged_updates(rank: int, world_size: int) -> None:
    group = dist.group.WORLD
    # Different seeds per rank: the initial state must come from rank 0 (SAC syncs it when built), not from
    # matching seeds.
    sac = make_sac(seed=10 + rank, group=group, policy_frequency=2, model=model_cfg(normalize_obs=True))
    assert _all_equal_across_ranks(flat_state(sac), world_size)
    for param in sac.critic_params:  # drift apart, then sync again
        param.data.add_(rank)
    sac.actor.obs_normalizer.update(torch.randn(16, 3) * (rank + 1))
    assert not _all_equal_across_ranks(flat_state(sac), world_size)
    sac.sync_from_first_trainer()
    assert _all_equal_across_ranks(flat_state(sac), world_size)
    assert _all_equal_across_ranks(sac.actor.obs_normalizer.mean, world_size)
    alone = make_sac(seed=0, policy_frequency=2, model=model_cfg(normalize_obs=True))  # the same start, alone
    alone.actor.load_state_dict(sac.actor.state_dict())
    alone.load_state_dict(sac.state_dict())

    for step in range(4):  # two actor phases; different batches and sampling noise on each rank
        torch.manual_seed(100 * step + rank)
        sac.update(replay_batch(32, seed=10 * step + rank))
        torch.manual_seed(100 * step + rank)
        alone.update(replay_batch(32, seed=10 * step + rank))
    assert _all_equal_across_ranks(flat_state(sac), world_size)
    assert not _all_equal_across_ranks(flat_state(alone), world_size)
    assert not torch.equal(flat_state(alone), flat_state(sac))


def test_averaged_gradients_keep_trainers_identical_after_actor_and_critic_steps():
    assert_all_ok(run_ranks(_averaged_updates, 2, timeout_s=30))


def _critic_steps_equal_one_process_on_the_whole_batch(rank: int, world_size: int) -> None:
    # gamma = 0 makes the TD target the reward and policy_frequency = 100 keeps the actor still, so the critic
    # steps do not depend on sampling noise and can be compared with one process on the concatenated batch.
    changes = dict(gamma=0.0, policy_frequency=100, target_network_frequency=1)
    sac = make_sac(seed=rank, group=dist.group.WORLD, **changes)
    sac.sync_from_first_trainer()
    reference = make_sac(seed=0, **changes)  # rank 0's initial state, updating alone
    for step in range(3):
        shares = [replay_batch(16, seed=10 * step + r) for r in range(world_size)]
        sac.update(shares[rank])
        reference.update(torch.cat(shares))
    torch.testing.assert_close(flat_state(sac), flat_state(reference), rtol=1e-5, atol=1e-6)
    # Adam hides a gradient's scale, so compare the last step's gradients too: a mean, not a sum, over ranks.
    averaged = torch.cat([p.grad.reshape(-1) for p in sac.critic_params])
    whole_batch = torch.cat([p.grad.reshape(-1) for p in reference.critic_params])
    torch.testing.assert_close(averaged, whole_batch, rtol=1e-4, atol=1e-6)


def test_averaged_critic_steps_equal_one_process_on_the_concatenated_batch():
    assert_all_ok(run_ranks(_critic_steps_equal_one_process_on_the_whole_batch, 2, timeout_s=30))
