"""An inference rank's policy is built to receive trainer 0's weights (run/policies.py, policy_to_receive): its
parameters zeros, never initialised nor read from a pretrained folder; its buffers the constructor's, non-persistent
ones included; tied parameters tied. Given trainer 0's state_dict it acts exactly as trainer 0's policy. A class
whose constructor needs its parameters' values is built as before."""

from __future__ import annotations

import pytest
import torch
from harness.vla_fixtures import make_model_folder

import spmd_rl.modules.pretrained as pretrained
from spmd_rl.config.loading import load_config
from spmd_rl.envs import spaces
from spmd_rl.envs.vector import probe_env
from spmd_rl.modules.actor_critic import ActorCritic
from spmd_rl.run.contract import load_classes
from spmd_rl.run.policies import build_policy, policy_to_receive

VLA_ENV = "env.id=tests.harness.vla_fixtures:InstructedReach-v0"


def _parts(*overrides):
    cfg = load_config(None, list(overrides))
    return cfg, probe_env(cfg.env), load_classes(cfg)[0]


def _acts_alike(received, built, spec):
    received.load_state_dict(built.state_dict())
    obs = spaces.zeros_of(spec.observation_space, 2)
    with torch.no_grad():
        a, b = received.act(obs, deterministic=True), built.act(obs, deterministic=True)
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0)


def test_an_mlp_is_received_as_zeros_and_acts_as_trainer_0s_once_given_its_weights():
    cfg, spec, cls = _parts("policy.hidden_sizes=[16,16]")
    received = policy_to_receive(cfg, spec, cls, "cpu")
    assert all(not p.is_meta and p.abs().sum() == 0 for p in received.parameters())
    built = build_policy(cfg, spec, cls)
    assert [n for n, _ in received.named_parameters()] == [n for n, _ in built.named_parameters()]
    _acts_alike(received, built, spec)


def test_a_pretrained_vla_is_not_read_again_and_keeps_its_buffers_and_ties(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    folder = make_model_folder(tmp_path / "model")
    cfg, spec, cls = _parts(VLA_ENV, "policy.class=vla", f"policy.pretrained={folder}")
    built = build_policy(cfg, spec, cls)

    def no_read(*args, **kwargs):
        raise AssertionError("the inference rank read the folder's weights")

    monkeypatch.setattr(pretrained, "_copy", no_read)
    received = policy_to_receive(cfg, spec, cls, "cpu")
    assert all(p.abs().sum() == 0 for p in received.parameters())
    buffers = dict(built.named_buffers(remove_duplicate=False))
    for name, buffer in received.named_buffers(remove_duplicate=False):  # rotary frequencies: in no state_dict
        torch.testing.assert_close(buffer, buffers[name], rtol=0, atol=0)
    tied = [
        p
        for n, p in received.named_parameters(remove_duplicate=False)
        if n.endswith(("embed_tokens.weight", "lm_head.weight"))
    ]
    assert len(tied) == 2 and tied[0] is tied[1]
    _acts_alike(received, built, spec)


class NeedsItsValues(ActorCritic):
    """A constructor that reads a parameter's value (a buffer computed from the initial weights)."""

    def __init__(self, observation_space, action_space, config):
        super().__init__(observation_space, action_space, config)
        first = next(self.parameters())
        self.register_buffer("initial_norm", first.detach().norm().reshape(1))


def test_a_class_that_needs_its_values_is_built_as_before():
    cfg, spec, _ = _parts("policy.hidden_sizes=[16,16]")
    received = policy_to_receive(cfg, spec, NeedsItsValues, "cpu")
    built = build_policy(cfg, spec, NeedsItsValues)
    for (name, a), (_, b) in zip(received.state_dict().items(), built.state_dict().items(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


class KeepsADerivedTensor(ActorCritic):
    """A constructor that keeps a plain tensor (no buffer) derived from a parameter and uses it in act: built with
    meta parameters it stayed on the meta device and act failed (fault pass 6, U7)."""

    def __init__(self, observation_space, action_space, config):
        super().__init__(observation_space, action_space, config)
        self.scale = next(self.parameters()).detach().abs().sum() * 0 + 1.0

    def act(self, obs, deterministic=False, *args):
        out = super().act(obs, deterministic, *args)
        out["value"] = out["value"] * self.scale
        return out


def test_a_class_that_keeps_a_tensor_derived_from_its_parameters_is_built_as_before():
    cfg, spec, _ = _parts("policy.hidden_sizes=[16,16]")
    received = policy_to_receive(cfg, spec, KeepsADerivedTensor, "cpu")
    assert not received.scale.is_meta
    _acts_alike(received, build_policy(cfg, spec, KeepsADerivedTensor), spec)
