"""policy.temperature: the built-in policies sample at it (a Gaussian's std times T, a categorical's logits over T)
and their log-probs, in act and in evaluate alike, are the tempered distribution's; the mode does not move."""

from __future__ import annotations

import dataclasses
import math

import gymnasium as gym
import numpy as np
import pytest
import torch

from spmd_rl.modules.actor_critic import ActorCritic
from spmd_rl.modules.configs import ActorCriticConfig, TransformerConfig, VLAConfig
from spmd_rl.modules.transformer import TransformerPolicy

T = 1.6
OBS = gym.spaces.Box(-1.0, 1.0, (3,), dtype=np.float32)
DISCRETE = gym.spaces.Discrete(4)
BOX = gym.spaces.Box(-1.0, 1.0, (2, 3), dtype=np.float32)  # an action chunk of 2 actions of 3


def pair(policy_cls, config, obs_space=OBS, action_space=BOX):
    """The same weights at temperature 1 and at T."""
    torch.manual_seed(0)
    plain = policy_cls(obs_space, action_space, config)
    hot = policy_cls(obs_space, action_space, dataclasses.replace(config, temperature=T))
    hot.load_state_dict(plain.state_dict())
    return plain, hot


def observations(space=OBS, batch: int = 5):
    torch.manual_seed(1)
    return torch.rand(batch, *space.shape) * 2 - 1


def check_gaussian(plain, hot, obs, spread: bool = True):
    torch.manual_seed(2)
    with torch.no_grad():
        out = hot.act(obs)
        mean = hot.act(obs, deterministic=True)["action"]
    assert torch.equal(mean, plain.act(obs, deterministic=True)["action"])  # the mode is the same
    std = hot.log_std.exp().reshape(mean.shape[1:]) * T
    expected = torch.distributions.Normal(mean, std).log_prob(out["action"]).flatten(1).sum(-1)
    torch.testing.assert_close(out["log_prob"], expected)
    log_prob, entropy, _ = hot.evaluate(obs, out["action"])
    torch.testing.assert_close(log_prob, out["log_prob"])  # the ratio's first value is 1
    plain_entropy = plain.evaluate(obs, out["action"])[1]
    torch.testing.assert_close(entropy, plain_entropy + mean[0].numel() * math.log(T))
    if not spread:
        return
    # The samples spread T times as wide.
    many = obs[:1].expand(20000, *obs.shape[1:])
    with torch.no_grad():
        spread = hot.act(many)["action"].std(0) / plain.act(many)["action"].std(0)
    torch.testing.assert_close(spread, torch.full_like(spread, T), rtol=0.05, atol=0.0)


def check_categorical(plain, hot, obs, actions):
    """actions: every action of a discrete space, each [B, ...]: the tempered log-probs are log_softmax(plain / T)."""
    with torch.no_grad():
        plain_all = torch.stack([plain.evaluate(obs, a)[0] for a in actions], -1)
        hot_all = torch.stack([hot.evaluate(obs, a)[0] for a in actions], -1)
        torch.testing.assert_close(hot_all, torch.log_softmax(plain_all / T, -1))
        torch.manual_seed(2)
        out = hot.act(obs)
        torch.testing.assert_close(hot.evaluate(obs, out["action"])[0], out["log_prob"])
        mode = hot.act(obs, deterministic=True)["action"]
    assert torch.equal(mode, plain.act(obs, deterministic=True)["action"])


def test_the_actor_critic_gaussian_samples_at_the_temperature():
    check_gaussian(*pair(ActorCritic, ActorCriticConfig()), observations())


def test_the_actor_critic_categorical_divides_its_logits():
    plain, hot = pair(ActorCritic, ActorCriticConfig(), action_space=DISCRETE)
    check_categorical(plain, hot, observations(), [torch.full((5,), a) for a in range(4)])


def test_the_actor_critic_bins_divide_their_logits():
    one = gym.spaces.Box(-1.0, 1.0, (1,), dtype=np.float32)  # one element: its bins are the whole distribution
    plain, hot = pair(ActorCritic, ActorCriticConfig(action_bins=5), action_space=one)
    check_categorical(plain, hot, observations(), [torch.full((5, 1), -1.0 + 0.5 * b) for b in range(5)])


def test_the_transformer_samples_at_the_temperature():
    vector = gym.spaces.Box(-1.0, 1.0, (3,), dtype=np.float32)
    check_gaussian(*pair(TransformerPolicy, TransformerConfig(), action_space=vector), observations())
    plain, hot = pair(TransformerPolicy, TransformerConfig(), action_space=DISCRETE)
    check_categorical(plain, hot, observations(), [torch.full((5,), a) for a in range(4)])


def test_the_vla_policy_samples_at_the_temperature():
    pytest.importorskip("transformers")
    from harness.vla_fixtures import InstructedReach

    from spmd_rl.envs import spaces
    from spmd_rl.modules.vla import VLAPolicy

    env = InstructedReach()
    obs = spaces.zeros_of(env.observation_space, 3)
    for i in range(3):
        spaces.write(spaces.numpy_views(obs), env.reset(seed=i)[0], i)
    check_gaussian(*pair(VLAPolicy, VLAConfig(), env.observation_space, env.action_space), obs, spread=False)
    plain, hot = pair(VLAPolicy, VLAConfig(action_head="bins"), env.observation_space, env.action_space)
    with torch.no_grad():
        torch.manual_seed(2)
        out = hot.act(obs)
        plain_log_prob = plain.evaluate(obs, out["action"])[0]
    torch.testing.assert_close(hot.evaluate(obs, out["action"])[0], out["log_prob"])
    assert not torch.allclose(plain_log_prob, out["log_prob"])


@pytest.mark.parametrize("config", [ActorCriticConfig, TransformerConfig, VLAConfig])
def test_temperature_one_is_left_out_of_config_yaml_and_the_run_directory_digest(config):
    field = next(f for f in dataclasses.fields(config) if f.name == "temperature")
    assert field.default == 1.0 and field.metadata["omit_default"]


@pytest.mark.parametrize("action_space", [DISCRETE, gym.spaces.Box(-1.0, 1.0, (3,), dtype=np.float32)])
def test_the_recurrent_actor_critic_learns_from_the_log_probs_it_sampled_at(action_space):
    from spmd_rl.interfaces.policy import initial_state
    from spmd_rl.modules.recurrent import RecurrentActorCritic, RecurrentActorCriticConfig

    plain, hot = pair(RecurrentActorCritic, RecurrentActorCriticConfig(), action_space=action_space)
    obs = observations()
    state = initial_state(hot.recurrent_state(), 5)
    torch.manual_seed(2)
    with torch.no_grad():
        out, _ = hot.act(obs, state=state)
        start = torch.ones(1, 5, dtype=torch.bool)
        log_prob = hot.evaluate_sequence(obs[None], out["action"][None], start, state)[0][0]
        plain_log_prob = plain.evaluate_sequence(obs[None], out["action"][None], start, state)[0][0]
    torch.testing.assert_close(log_prob, out["log_prob"])
    assert not torch.allclose(plain_log_prob, log_prob)
