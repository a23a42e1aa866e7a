"""The policy's static spec (run/contract.py's PolicySpec): the checks before start read an instance on the meta
device, so they construct no policy with real tensors (Policy.real_constructions, what finished.json's policy_builds
counts); a policy whose code reads values is checked on a CPU instance instead, with the same result. Rank 0's
unsharded copy (run/policies.py's cpu_copy) holds the policy's tensors, tied and non-persistent ones too, without
a second construction. The spec travels to env ranks as text and reads back the same."""

from __future__ import annotations

import pytest
import torch
from harness.vla_fixtures import InstructedReach
from torch import nn

from spmd_rl.api import Policy, StepField
from spmd_rl.config.loading import load_config
from spmd_rl.envs.vector import probe_env
from spmd_rl.run import contract
from spmd_rl.run.policies import PolicySpec, build_policy, cpu_copy
from spmd_rl.runtime.errors import UserError

RECURRENT_PPO = "spmd_rl.algorithms.recurrent_ppo:RecurrentPPO"


def checked(*overrides: str, policy_cls=None):
    cfg = load_config(None, list(overrides))
    loaded_cls, algorithm_cls, _, _ = contract.load_classes(cfg)
    policy_cls = policy_cls or loaded_cls
    spec = probe_env(cfg.env)
    before = Policy.real_constructions
    policy_spec = contract.check_policy(cfg, spec, policy_cls, algorithm_cls)
    return policy_spec, Policy.real_constructions - before, build_policy(cfg, spec, policy_cls)


@pytest.mark.parametrize(
    "overrides",
    [
        (),
        ("policy.class=transformer",),
        (
            "policy.class=spmd_rl.modules.recurrent:RecurrentActorCritic",
            "algo.class=spmd_rl.algorithms.recurrent_ppo:RecurrentPPO",
        ),
        ("algo.class=sac", "env.id=Pendulum-v1"),
    ],
)
def test_the_checks_before_start_construct_no_built_in_policy_and_read_its_real_size(overrides):
    policy_spec, constructions, policy = checked(*overrides)
    assert constructions == 0
    assert policy_spec.outputs == policy.outputs() and policy_spec.recurrent_state == policy.recurrent_state()
    assert policy_spec.parameters == sum(p.numel() for p in policy.parameters())
    assert policy_spec.parameter_bytes == sum(p.numel() * p.element_size() for p in policy.parameters())
    assert policy_spec.trained_parameters == policy_spec.parameters and policy_spec.shard_units >= 1
    assert PolicySpec.from_text(policy_spec.to_text()) == policy_spec  # as env ranks receive it


def test_the_vla_preset_is_checked_on_the_meta_device_with_its_lora_adapters_frozen_base_counted():
    pytest.importorskip("peft")
    env = "env.id=tests.harness.vla_fixtures:InstructedReach-v0"
    policy_spec, constructions, policy = checked(env, "policy.class=vla", "policy.preset=tiny", "policy.lora.rank=4")
    assert constructions == 0
    assert policy_spec.parameters == sum(p.numel() for p in policy.parameters())
    assert policy_spec.trained_parameters == sum(p.numel() for p in policy.parameters() if p.requires_grad)
    assert policy_spec.trained_parameters < policy_spec.parameters // 10
    assert isinstance(InstructedReach().observation_space, type(policy.observation_space))


class ReadsValues(Policy):
    """A policy whose act reads a tensor's value (data-dependent code the meta device cannot run)."""

    def __init__(self, observation_space, action_space, config):
        super().__init__(observation_space, action_space, config)
        self.logits = nn.Linear(4, 2)

    def outputs(self):
        return {"action": StepField((), torch.int64), "log_prob": StepField((), torch.float32),
                "value": StepField((), torch.float32)}  # fmt: skip

    def act(self, obs, deterministic=False):
        scale = float(obs.abs().max().item()) or 1.0
        action = self.logits(obs / scale).argmax(-1)
        return {"action": action, "log_prob": torch.zeros(len(obs)), "value": torch.zeros(len(obs))}

    def evaluate(self, obs, action):
        return torch.zeros(len(obs)), torch.zeros(len(obs)), torch.zeros(len(obs))

    def forward(self, obs, action):
        return self.evaluate(obs, action)

    def value(self, obs):
        return torch.zeros(len(obs))


def test_a_policy_that_reads_values_is_checked_on_one_cpu_instance_instead():
    policy_spec, constructions, _ = checked(policy_cls=ReadsValues)
    assert constructions == 1 and list(policy_spec.outputs) == ["action", "log_prob", "value"]


class TiedWithBuffer(Policy):
    def __init__(self, observation_space, action_space, config):
        super().__init__(observation_space, action_space, config)
        self.embed = nn.Linear(3, 3, bias=False)
        self.head = nn.Linear(3, 3, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.rand(3), persistent=False)


def test_the_unsharded_copy_holds_every_tensor_without_a_second_construction():
    cfg = load_config(None, [])
    spec = probe_env(cfg.env)
    policy = TiedWithBuffer(spec.observation_space, spec.action_space, cfg.policy)
    before = Policy.real_constructions
    copy = cpu_copy(policy, cfg, spec, TiedWithBuffer, [])
    assert Policy.real_constructions == before
    assert torch.equal(copy.embed.weight, policy.embed.weight) and torch.equal(copy.head.weight, policy.head.weight)
    assert torch.equal(copy.scale, policy.scale) and copy.scale.data_ptr() != policy.scale.data_ptr()


class ActFails(ReadsValues):
    def act(self, obs, deterministic=False):
        raise RuntimeError("act is broken")


def test_without_calls_the_check_reads_what_the_policy_declares_and_leaves_act_to_rank_0():
    # A building rank other than rank 0 in a layout with env ranks: rank 0's calls speak for it.
    cfg = load_config(None, [])
    spec = probe_env(cfg.env)
    algorithm_cls = contract.load_classes(cfg)[1]
    declared = contract.check_policy(cfg, spec, ActFails, algorithm_cls, calls=False)
    assert list(declared.outputs) == ["action", "log_prob", "value"] and declared.parameters == 10
    with pytest.raises(UserError, match="act is broken"):
        contract.check_policy(cfg, spec, ActFails, algorithm_cls)


class CountsActs(ReadsValues):
    """Draws random numbers and changes a buffer in act: what the check's calls must leave as they found them."""

    def __init__(self, observation_space, action_space, config):
        super().__init__(observation_space, action_space, config)
        self.register_buffer("acts", torch.zeros(()))

    def act(self, obs, deterministic=False):
        self.acts += 1
        torch.rand(5)
        return super().act(obs, deterministic)


def test_the_calls_on_the_instance_rank_0_trains_with_leave_its_buffers_and_torch_random_state_as_they_were():
    cfg = load_config(None, [])
    spec = probe_env(cfg.env)
    algorithm_cls = contract.load_classes(cfg)[1]
    declared = contract.check_policy(cfg, spec, CountsActs, algorithm_cls, calls=False)
    policy = build_policy(cfg, spec, CountsActs)
    rng = torch.get_rng_state()
    contract.check_calls(cfg, spec, algorithm_cls, policy, declared)
    assert torch.equal(torch.get_rng_state(), rng) and policy.acts.item() == 0
    with pytest.raises(UserError, match="act is broken"):
        contract.check_calls(cfg, spec, algorithm_cls, build_policy(cfg, spec, ActFails), declared)
