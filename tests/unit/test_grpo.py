"""GRPO's pieces by hand: episode outcomes (returns and successes) from an episode rollout, which outcome a config
judges by, group-relative advantages, dynamic sampling, the clip-higher objective, and the KL's reference policy
(the initial values of the trainable parameters, swapped into the policy for its log-probs; each fsdp trainer holds
only its shards of them)."""

import copy

import gymnasium as gym
import numpy as np
import pytest
import torch
import torch.distributed as dist
from harness import instructed_env  # noqa: F401  (registers Instructed-v0)
from harness.multiproc import assert_all_ok, run_ranks
from tensordict import TensorDict

from spmd_rl.algorithms.configs import GRPOConfig
from spmd_rl.algorithms.grpo import (
    GRPO,
    episode_returns,
    episode_successes,
    group_advantages,
    grpo_losses,
    success_outcome,
)
from spmd_rl.config.loading import load_config
from spmd_rl.envs.vector import probe_env
from spmd_rl.interfaces.context import Context
from spmd_rl.modules.actor_critic import ActorCritic
from spmd_rl.modules.configs import ActorCriticConfig
from spmd_rl.runtime.errors import UserError


def test_a_return_outcome_is_the_return_of_the_episode_the_column_ran_in_the_rollout():
    # 3 decisions x 2 columns x chunks of 2: column 0's episode ends after decision 1 (its last decision's second
    # step did not run), column 1 runs all three.
    reward = torch.tensor([[[1.0, 2.0], [10.0, 20.0]], [[3.0, 99.0], [30.0, 40.0]], [[5.0, 6.0], [50.0, 60.0]]])
    chunk_valid = torch.tensor([[[1, 1], [1, 1]], [[1, 0], [1, 1]], [[1, 1], [1, 1]]], dtype=torch.bool)
    active = torch.tensor([[True, True], [True, True], [False, True]])
    rollout = TensorDict({"reward": reward, "chunk_valid": chunk_valid, "active": active}, batch_size=[3, 2])
    assert episode_returns(rollout).tolist() == [1 + 2 + 3, 10 + 20 + 30 + 40 + 50 + 60]


def test_a_success_outcome_is_whether_the_episode_the_column_ran_succeeded_at_any_step():
    # The env side sets episode_success at the decision that ends an episode (success at any of its steps); column
    # 1's later episode (inactive: the vector env autoreset it) succeeds but is no part of the rollout.
    episode_success = torch.tensor([[False, False, False], [True, False, False], [False, True, False]])
    active = torch.tensor([[True, True, True], [True, True, True], [False, False, True]])
    rollout = TensorDict({"episode_success": episode_success, "active": active}, batch_size=[3, 3])
    assert episode_successes(rollout).tolist() == [1.0, 0.0, 0.0]


def test_the_outcome_is_success_where_the_env_reports_it_unless_return_is_asked():
    with_flag, without = ["reward", "episode_success"], ["reward"]
    assert success_outcome("auto", with_flag) and not success_outcome("auto", without)
    assert success_outcome("success", with_flag) and not success_outcome("return", with_flag)


def test_a_success_outcome_needs_an_env_that_reports_success_before_start():
    from spmd_rl.run import contract

    assert GRPO.required_fields(GRPOConfig()) == ("log_prob",)
    assert GRPO.required_fields(GRPOConfig(outcome="success"))[1:] == ("episode_success", "episode_success_at_end")
    overrides = ["algo.class=grpo", "algo.outcome=success", "env.group_size=2", "env.num_envs=2"]
    reporting = load_config(None, [*overrides, "env.id=tests.harness.instructed_env:Instructed-v0"])
    policy_cls, algorithm_cls, _, _ = contract.load_classes(reporting)
    contract.check_policy(reporting, probe_env(reporting.env), policy_cls, algorithm_cls)
    cartpole = load_config(None, overrides)
    with pytest.raises(UserError, match=r"only for an env whose step info has a success flag; env 'CartPole-v1'"):
        contract.check_policy(cartpole, probe_env(cartpole.env), policy_cls, algorithm_cls)


def test_advantages_are_relative_to_the_group_and_flat_groups_are_dropped_when_asked():
    outcome = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 3.0])
    advantage, kept = group_advantages(outcome, 4, std_eps=0.0, filter_groups=True)
    # group 0: mean 0.5, unbiased std sqrt(1/3); group 1 is flat; group 2: mean 0.75, std 1.5
    s = (1 / 3) ** 0.5
    expected = [0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s, 0, 0, 0, 0, -0.5, -0.5, -0.5, 1.5]
    torch.testing.assert_close(advantage, torch.tensor(expected))
    assert kept.tolist() == [True] * 4 + [False] * 4 + [True] * 4
    _, kept = group_advantages(outcome, 4, std_eps=1e-6, filter_groups=False)
    assert kept.all()


def test_the_ratio_is_clipped_higher_above_than_below():
    cfg = GRPOConfig(clip_low=0.2, clip_high=0.28)
    old = torch.zeros(4)
    new = torch.log(torch.tensor([1.5, 1.5, 0.5, 0.5]))  # ratios 1.5 and 0.5
    advantage = torch.tensor([1.0, -1.0, 1.0, -1.0])
    weight = torch.full((4,), 0.25)
    losses = grpo_losses(new, old, None, torch.zeros(4), advantage, weight, cfg)
    # min(A r, A clip(r)): A=1, r=1.5 -> 1.28; A=-1, r=1.5 -> -1.5; A=1, r=0.5 -> 0.5; A=-1, r=0.5 -> -0.8
    torch.testing.assert_close(losses["policy_loss"], -torch.tensor(1.28 - 1.5 + 0.5 - 0.8) / 4)
    assert losses["clip_fraction"].item() == 1.0 and "kl_ref" not in losses
    ref = torch.zeros(4)
    k3 = grpo_losses(new, old, ref, torch.zeros(4), advantage, weight, cfg)["kl_ref"]
    torch.testing.assert_close(k3, ((1 / torch.tensor([1.5, 1.5, 0.5, 0.5])) - 1 + new).mean())


def test_a_refill_is_planned_in_one_process_and_colocated_and_refused_in_the_split_layout():
    from spmd_rl.run.plan import plan_run
    from spmd_rl.run.topology import build_topology

    overrides = ["algo.class=grpo", "env.group_size=2", "algo.filter_groups=true", "algo.max_resample_rounds=2"]
    one = load_config(None, [*overrides, "env.id=Pendulum-v1"])
    assert plan_run(one, build_topology(one.layout, 1), GRPO).colocated
    colocated = load_config(None, [*overrides, "env.id=Pendulum-v1", "layout.mode=colocated"])
    assert plan_run(colocated, build_topology(colocated.layout, 2), GRPO).colocated
    split = load_config(
        None,
        [
            *overrides,
            "env.id=Pendulum-v1",
            "layout.mode=split",
            "layout.trainer=1",
            "layout.inference=1",
            "layout.env=1",
        ],
    )
    with pytest.raises(UserError, match=r"algo.max_resample_rounds=2 .* set layout.mode=colocated"):
        plan_run(split, build_topology(split.layout, 3), GRPO)


OBS, ACTIONS = gym.spaces.Box(-1, 1, (3,), np.float32), gym.spaces.Box(-2, 2, (2,), np.float32)


def _policy_and_batch() -> tuple[ActorCritic, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    policy = ActorCritic(OBS, ACTIONS, ActorCriticConfig(hidden_sizes=[8, 8]))
    return policy, torch.randn(16, 3), torch.randn(16, 2)


@torch.no_grad()
def _perturb(module: torch.nn.Module) -> None:
    """As updates would: every trainable parameter moved (its local shard under fsdp)."""
    for param in module.parameters():
        if param.requires_grad:
            local = param.to_local() if hasattr(param, "to_local") else param
            local.add_(0.1 * torch.randn_like(local))


def test_the_reference_log_probs_are_a_deepcopied_initial_policys_and_the_policy_is_left_untouched():
    policy, obs, action = _policy_and_batch()
    initial = copy.deepcopy(policy)
    grpo = GRPO(policy, GRPOConfig(kl_coef=0.05), Context.local(OBS, ACTIONS))
    assert GRPO.takes_policy_on_meta(GRPOConfig(kl_coef=0.05))
    assert grpo.reference is not None and set(grpo.reference) == {n for n, p in policy.named_parameters()}
    _perturb(policy)
    current = {name: value.clone() for name, value in policy.state_dict().items()}
    with torch.no_grad():
        expected, mine = initial(obs, action)[0], policy(obs, action)[0]
    assert torch.equal(grpo._reference_log_prob(obs, action), expected)
    assert all(torch.equal(value, current[name]) for name, value in policy.state_dict().items())
    assert all(param.grad is None for param in policy.parameters()) and not grpo.optimizer.state
    with torch.no_grad():
        assert torch.equal(policy(obs, action)[0], mine)


def test_a_checkpoint_whose_reference_is_a_whole_policys_state_dict_still_loads():
    # Checkpoints written before the reference became values held the reference policy's state dict (buffers and
    # all, ActorCritic's pair saved as two MLPs): its trainable parameters' entries are taken.
    policy, obs, action = _policy_and_batch()
    grpo = GRPO(policy, GRPOConfig(kl_coef=0.05), Context.local(OBS, ACTIONS))
    older = copy.deepcopy(policy)
    _perturb(older)
    assert "actor.0.weight" in older.state_dict()
    grpo.load_state_dict({"optimizer": grpo.optimizer.state_dict(), "reference": older.state_dict()})
    assert torch.equal(grpo.reference["log_std"], older.log_std)
    with torch.no_grad():
        assert torch.equal(grpo._reference_log_prob(obs, action), older(obs, action)[0])
        assert not torch.equal(policy(obs, action)[0], older(obs, action)[0])


def _reference_of_fsdp_trainers(rank: int, world_size: int) -> None:
    policy, obs, action = _policy_and_batch()
    initial = copy.deepcopy(policy)
    context = Context.local(OBS, ACTIONS, group=dist.group.WORLD, parallel="fsdp")
    grpo = GRPO(policy, GRPOConfig(kl_coef=0.05), context)
    assert grpo.reference is not None
    params = dict(policy.named_parameters())
    # This trainer's shards alone: each reference tensor is as large as its parameter's local shard.
    local = {name: value.to_local() for name, value in grpo.reference.items()}
    assert all(local[name].shape == params[name].to_local().shape for name in local)
    whole = sum(param.numel() for param in initial.parameters())
    assert sum(value.numel() for value in local.values()) <= whole // world_size + len(local)
    _perturb(policy)
    with torch.no_grad():
        mine = policy(obs, action)[0]  # leaves the root's parameters gathered (a forward without grad)
        assert torch.equal(grpo._reference_log_prob(obs, action), initial(obs, action)[0])
        assert torch.equal(policy(obs, action)[0], mine)  # the policy's own values again, not the reference's
    # A checkpoint of the older format: the whole reference policy's state dict; each trainer takes its rows.
    for value in grpo.reference.values():
        value.to_local().zero_()
    grpo.load_state_dict({"optimizer": grpo.optimizer.state_dict(), "reference": initial.state_dict()})
    with torch.no_grad():
        assert torch.equal(grpo._reference_log_prob(obs, action), initial(obs, action)[0])


def test_fsdp_trainers_hold_only_their_shards_of_the_reference_and_its_log_probs_are_the_initial_policys():
    assert_all_ok(run_ranks(_reference_of_fsdp_trainers, 2))
