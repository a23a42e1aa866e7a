"""The math behind the faster learner (issue 16): the actor and critic packed side by side (TwinMLP), Gumbel-max
sampling, the epoch-wide minibatch weights and the one-tensor PPO losses, each against the plain form it replaces."""

from __future__ import annotations

import gymnasium as gym
import pytest
import torch
from torch import nn

from spmd_rl.algorithms.configs import PPOConfig
from spmd_rl.algorithms.optimizer_step import clip_grad_norm
from spmd_rl.algorithms.ppo import (
    LOSS_NAMES,
    PPO,
    clipped_losses,
    epoch_minibatches,
    loss_coefficients,
    minibatch_weights,
    ppo_losses,
    total_loss,
)
from spmd_rl.interfaces.context import Context
from spmd_rl.modules.actor_critic import ActorCritic, TwinMLP
from spmd_rl.modules.configs import ActorCriticConfig
from spmd_rl.modules.mlp import mlp

OBS = gym.spaces.Box(-5, 5, (4,))


@pytest.mark.parametrize("hidden, outputs", [([64, 64], (2, 1)), ([], (3, 1)), ([8, 16, 4], (1, 5))])
def test_twin_mlp_equals_the_two_mlps_it_packs_forward_and_backward(hidden, outputs):
    torch.manual_seed(0)
    first, second = (mlp(4, hidden, n, "tanh", head_gain=1.0) for n in outputs)
    twin = TwinMLP(first, second, "tanh")
    x = torch.randn(32, 4)
    a, b = twin(x)
    torch.testing.assert_close(a, first(x))
    torch.testing.assert_close(b, second(x))
    # The gradients of any loss, unpacked, are the separate networks' gradients; the padding gets none.
    (a.square().sum() + b.sin().sum()).backward()
    (first(x).square().sum() + second(x).sin().sum()).backward()
    separate_grads = {f"{i}.{k}": p.grad for i, net in enumerate((first, second)) for k, p in net.named_parameters()}
    for k, (weight, bias) in enumerate(twin.layers()):
        for i, width in enumerate(twin.widths[k]):
            torch.testing.assert_close(weight.grad[i, :, :width].t(), separate_grads[f"{i}.{2 * k}.weight"])
            torch.testing.assert_close(bias.grad[i, 0, :width], separate_grads[f"{i}.{2 * k}.bias"])
            assert not weight.grad[i, :, width:].any() and not bias.grad[i, 0, width:].any()


def test_the_actor_critic_saves_and_loads_the_two_mlp_layout():
    torch.manual_seed(0)
    policy = ActorCritic(OBS, gym.spaces.Discrete(3), ActorCriticConfig())
    state = policy.state_dict()
    assert [k for k in state if k.startswith(("actor.", "critic."))] == [
        f"{net}.{layer}.{kind}" for net in ("actor", "critic") for layer in (0, 2, 4) for kind in ("weight", "bias")
    ]
    assert state["actor.0.weight"].shape == (64, 4) and state["critic.4.weight"].shape == (1, 64)
    torch.testing.assert_close(policy.actor[0].weight, state["actor.0.weight"])
    other = ActorCritic(OBS, gym.spaces.Discrete(3), ActorCriticConfig())
    other.load_state_dict(state)
    obs = torch.randn(16, 4)
    action = torch.randint(0, 3, (16,))
    for mine, theirs in zip(policy.evaluate(obs, action), other.evaluate(obs, action)):
        torch.testing.assert_close(mine, theirs)


def test_gumbel_max_sampling_draws_each_action_with_its_probability():
    torch.manual_seed(0)
    policy = ActorCritic(OBS, gym.spaces.Discrete(3), ActorCriticConfig())
    obs = torch.randn(1, 4).expand(20_000, 4)
    with torch.no_grad():
        out = policy.act(obs)
        probs = torch.softmax(policy.actor(obs[:1]), -1)[0]
    frequencies = torch.bincount(out["action"], minlength=3).float() / obs.shape[0]
    torch.testing.assert_close(frequencies, probs, atol=0.015, rtol=0)
    torch.testing.assert_close(out["log_prob"], probs.log()[out["action"]])


def minibatch(size: int, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    valid = torch.rand(size, generator=generator) > 0.2
    return {
        "obs": torch.randn(size, 4, generator=generator),
        "action": torch.randint(0, 2, (size,), generator=generator),
        "valid": valid,
        **{
            key: torch.where(valid, torch.randn(size, generator=generator), 0.0)
            for key in ("log_prob", "advantage", "return_", "value")
        },
    }


@pytest.mark.parametrize("size, parts", [(64, 4), (67, 4), (10, 3), (5, 5)])
def test_epoch_minibatches_weights_equal_each_minibatchs_own(size, parts):
    """Weights computed for the whole shuffled epoch at once are those of each minibatch alone (sizes differing
    by one, minibatches with one or no valid entry included)."""
    data = minibatch(size, seed=size)
    data["valid"][: size // 2] = False  # some minibatches with few or no valid entries
    torch.manual_seed(1)
    seen = []
    for part, share, advantage in epoch_minibatches(data, parts, normalize=True):
        own_share, own_advantage = minibatch_weights(part["valid"], part["advantage"], normalize=True)
        torch.testing.assert_close(share, own_share)
        torch.testing.assert_close(advantage, own_advantage)
        seen.append(part["obs"])
    torch.manual_seed(1)
    expected = torch.randperm(size).tensor_split(parts)
    assert [len(s) for s in seen] == [len(e) for e in expected]
    torch.testing.assert_close(torch.cat(seen), data["obs"][torch.cat(expected)])


@pytest.mark.parametrize("ent_coef, clip_value_loss", [(0.0, False), (0.01, True)])
def test_one_tensor_losses_equal_the_losses_written_one_by_one(ent_coef, clip_value_loss):
    cfg = PPOConfig(ent_coef=ent_coef, clip_value_loss=clip_value_loss)
    data = minibatch(48, seed=3)
    torch.manual_seed(0)
    policy = ActorCritic(OBS, gym.spaces.Discrete(2), ActorCriticConfig())
    new_log_prob, entropy, new_value = policy.evaluate(data["obs"], data["action"])
    share, advantage = minibatch_weights(data["valid"], data["advantage"], normalize=True)
    losses = clipped_losses(data, share, advantage, new_log_prob, entropy, new_value, 0.2, cfg)

    # The plain form: means over the valid entries, one loss at a time.
    valid = data["valid"]
    ratio = (new_log_prob - data["log_prob"]).exp()[valid]
    adv = advantage[valid]
    value = new_value[valid]
    if clip_value_loss:
        value = data["value"][valid] + (value - data["value"][valid]).clamp(-0.2, 0.2)
    expected = {
        "policy_loss": -torch.min(adv * ratio, adv * ratio.clamp(0.8, 1.2)).mean(),
        "value_loss": (value - data["return_"][valid]).square().mean(),
        "entropy": entropy[valid].mean(),
        "approx_kl": ((ratio - 1) - ratio.log()).mean(),
        "clip_fraction": ((ratio - 1).abs() > 0.2).float().mean(),
    }
    for name, value in zip(LOSS_NAMES, losses):
        torch.testing.assert_close(value, expected[name], msg=name)
    by_name = ppo_losses(data, new_log_prob, entropy, new_value, 0.2, cfg)
    torch.testing.assert_close(losses @ loss_coefficients(cfg), total_loss(by_name, cfg))
    # The total's gradient is the one-by-one total's (with ent_coef 0 the entropy carries none and needs none).
    grads = torch.autograd.grad(losses @ loss_coefficients(cfg), list(policy.parameters()), retain_graph=True)
    plain = expected["policy_loss"] - ent_coef * expected["entropy"] + cfg.vf_coef * expected["value_loss"]
    for mine, reference in zip(grads, torch.autograd.grad(plain, list(policy.parameters()))):
        torch.testing.assert_close(mine, reference)


def test_ppos_gradient_clipping_matches_torchs_on_its_own_parameters():
    torch.manual_seed(0)
    actions = gym.spaces.Box(-1, 1, (2,))
    policy = ActorCritic(OBS, actions, ActorCriticConfig())
    ppo = PPO(policy, PPOConfig(max_grad_norm=0.1), Context.local(OBS, actions))
    log_prob, _, value = policy.evaluate(torch.randn(32, 4), torch.randn(32, 2))
    (log_prob.sum() + value.square().sum()).backward()
    reference = [nn.Parameter(p.detach().clone()) for p in policy.parameters()]
    for copy, param in zip(reference, policy.parameters()):
        copy.grad = param.grad.clone()
    nn.utils.clip_grad_norm_(reference, 0.1)
    clip_grad_norm(ppo.parameters, ppo.cfg.max_grad_norm)  # what PPO's update calls after each backward
    for param, expected in zip(policy.parameters(), reference):
        assert torch.equal(param.grad, expected.grad)  # the same numbers, bit for bit
