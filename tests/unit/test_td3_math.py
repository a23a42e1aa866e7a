"""TD3's math (`algo.class: td3`, `policy.class: deterministic_actor`): the smoothed TD target, the delayed actor
and target updates, and acting with clipped exploration noise. End to end: tests/runs/test_td3_resume.py (one process)
and tests/launchers/test_td3_layouts.py (colocated and split)."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import torch
from harness.parts import random_transitions
from tensordict import TensorDict

from spmd_rl.algorithms.configs import TD3Config
from spmd_rl.algorithms.td3 import TD3
from spmd_rl.api import Context
from spmd_rl.modules.configs import DeterministicActorConfig
from spmd_rl.modules.deterministic_actor import DeterministicActor

OBS = gym.spaces.Box(-np.inf, np.inf, (3,), np.float32)
ACTIONS = gym.spaces.Box(np.array([-2.0, 0.0], np.float32), np.array([2.0, 10.0], np.float32))


def make_td3(noise: float = 0.1, **changes) -> TD3:
    torch.manual_seed(0)
    actor = DeterministicActor(OBS, ACTIONS, DeterministicActorConfig(hidden_sizes=[16], exploration_noise=noise))
    config = TD3Config(critic_hidden_sizes=[16], **changes)
    return TD3(actor, config, Context.local(OBS, ACTIONS))


def batch_of(size: int, seed: int) -> TensorDict:
    return random_transitions(ACTIONS, size, seed, terminated_fraction=0.3)


def test_without_smoothing_the_target_is_the_smaller_target_critic_at_the_target_actors_action():
    td3 = make_td3(target_policy_noise=0.0, gamma=0.5)
    with torch.no_grad():  # targets unlike the online networks, so that using the wrong one shows
        for param in [*td3.critic_target.parameters(), *td3.actor_target.parameters()]:
            param.add_(torch.randn_like(param))
    batch = batch_of(64, seed=1)
    target = td3.td_target(batch["reward"], batch["next_obs"], batch["terminated"])
    with torch.no_grad():
        next_action = td3.actor_target(batch["next_obs"])
        q1, q2 = td3.critic_target(batch["next_obs"], next_action)
    expected = batch["reward"] + torch.where(batch["terminated"], 0.0, 0.5 * torch.min(q1, q2))
    assert torch.allclose(target, expected)
    assert (q1 != q2).all()  # both critics are there, and the smaller one is taken row by row


def test_the_smoothing_noise_is_clipped_and_the_smoothed_action_stays_within_the_bounds():
    td3 = make_td3(target_policy_noise=1000.0, target_noise_clip=0.25)  # (almost) every draw is clipped
    seen = []
    critic_target = td3.critic_target

    def recording(obs, action):
        seen.append(action)
        return critic_target.__class__.forward(critic_target, obs, action)

    td3.critic_target = type("Recording", (), {"__call__": staticmethod(recording)})()
    batch = batch_of(256, seed=2)
    td3.td_target(batch["reward"], batch["next_obs"], batch["terminated"])
    with torch.no_grad():
        mu = td3.actor_target(batch["next_obs"])
    scale, low, high = td3.actor.action_scale, torch.as_tensor(ACTIONS.low), torch.as_tensor(ACTIONS.high)
    (smoothed,) = seen
    assert (smoothed >= low).all() and (smoothed <= high).all()
    inside = ((mu - low) > 0.25 * scale) & ((high - mu) > 0.25 * scale)  # not clipped by a bound
    shift = (smoothed - mu).abs()[inside] / scale.expand_as(mu)[inside]
    assert inside.sum() > 100 and torch.allclose(shift, torch.full_like(shift, 0.25), atol=1e-5)


def test_the_actor_and_the_targets_move_only_every_policy_delay_th_update():
    td3 = make_td3(policy_delay=3)
    tracked = {
        "actor": lambda: td3.actor.net[0].weight,
        "actor_target": lambda: td3.actor_target.net[0].weight,
        "critic_target": lambda: td3.critic_target.q1[0].weight,
        "critic": lambda: td3.critic.q1[0].weight,
    }
    moved = {name: [] for name in tracked}
    for step in range(6):
        before = {name: get().detach().clone() for name, get in tracked.items()}
        metrics = td3.update(batch_of(32, seed=step))
        for name, get in tracked.items():
            moved[name].append(not torch.equal(before[name], get()))
        assert ("actor_loss" in metrics) == ((step + 1) % 3 == 0)
    assert moved["critic"] == [True] * 6
    for name in ("actor", "actor_target", "critic_target"):
        assert moved[name] == [False, False, True, False, False, True], name


def test_the_critics_fit_a_fixed_batch():
    td3 = make_td3(q_lr=1e-2, gamma=0.0)  # the TD target is the reward: a fixed regression
    batch = batch_of(64, seed=3)
    losses = [td3.update(batch)["qf_loss"] for _ in range(60)]
    assert losses[-1] < 0.7 * losses[0]  # random rewards: the small critics fit part of them


def test_acting_adds_clipped_noise_and_deterministic_acting_adds_none():
    actor = make_td3(noise=0.5).actor
    obs = torch.randn(512, 3)
    with torch.no_grad():
        mu = actor(obs)
    assert torch.equal(actor.act(obs, deterministic=True)["action"], mu)
    explored = actor.act(obs)["action"]
    low, high = torch.as_tensor(ACTIONS.low), torch.as_tensor(ACTIONS.high)
    assert (explored >= low).all() and (explored <= high).all()
    noise = (explored - mu) / actor.action_scale
    unclipped = noise[(explored > low) & (explored < high)]
    assert abs(unclipped.std().item() - 0.5) < 0.1  # in units of the half-range, as SB3's noise on [-1, 1]
    assert torch.equal(make_td3(noise=0.0).actor.act(obs)["action"], mu)


def test_the_actor_loss_climbs_the_first_critic_alone_and_the_first_critic_alone_is_forward_s():
    td3 = make_td3()
    obs = batch_of(32, seed=4)["obs"]
    with torch.no_grad():
        action = td3.actor(obs)
        q1, q2 = td3.critic(obs, action)
        assert torch.equal(td3.critic.q1_value(obs, action), q1) and not torch.equal(q1, q2)
        assert torch.equal(td3.actor_loss(obs), -q1.mean())
