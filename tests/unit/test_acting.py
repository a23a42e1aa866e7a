"""The one acting path (spmd_rl/roles/acting.py): a forward pass without grad on the policy's device, a recurrent
state in and out, the outputs checked; a server's step around it (warm-up actions, the per-env state, replies
with their rows, version and time)."""

from __future__ import annotations

import copy

import gymnasium as gym
import numpy as np
import pytest
import torch
from harness.parts import CARTPOLE_OBS, actor_critic_cfg
from harness.recurrent_plugins import CountingPolicy

from spmd_rl.modules.actor_critic import ActorCritic
from spmd_rl.roles.acting import act, act_for_replies, write_reply
from spmd_rl.roles.inference_server import RecurrentStates, UniformActions
from spmd_rl.run.policies import accepts_gymnasium_observations
from spmd_rl.runtime.errors import UserCodeError

ACTIONS = gym.spaces.Discrete(2)


def policy() -> ActorCritic:
    torch.manual_seed(0)
    return ActorCritic(CARTPOLE_OBS, ACTIONS, actor_critic_cfg(hidden_sizes=[8]))


def test_acting_needs_no_grad_and_gives_the_policys_own_outputs():
    net, obs = policy(), torch.randn(5, 4)
    torch.manual_seed(1)
    out, next_state = act(net, obs, torch.device("cpu"), deterministic=True, fields=dict(net.outputs()))
    assert next_state is None and not any(value.requires_grad for value in out.values())
    torch.manual_seed(1)
    with torch.no_grad():
        expected = net.act(obs, deterministic=True)
    assert all(torch.equal(out[key], expected[key]) for key in expected)


def test_outputs_that_break_the_declared_fields_are_a_user_code_error_naming_the_key():
    net = policy()
    fields = {**net.outputs(), "extra": net.outputs()["value"]}
    with pytest.raises(UserCodeError, match="act\\(\\) returned 'extra' as nothing"):
        act(net, torch.randn(3, 4), torch.device("cpu"), fields=fields)


def test_a_recurrent_policy_gets_its_state_and_returns_the_next():
    counting = CountingPolicy(CARTPOLE_OBS, ACTIONS, None)
    out, next_state = act(counting, torch.randn(2, 4), torch.device("cpu"), state={"steps": torch.tensor([0.0, 3.0])})
    assert out["count"].tolist() == [0.0, 3.0] and next_state["steps"].tolist() == [1.0, 4.0]


def test_a_server_step_resets_states_at_episode_starts_and_fills_each_reply():
    counting = CountingPolicy(CARTPOLE_OBS, ACTIONS, None)
    fields = dict(counting.outputs())
    states = RecurrentStates(counting.recurrent_state(), [2, 1], torch.device("cpu"))
    states.state["steps"] = torch.tensor([5.0, 6.0, 7.0])
    replies = [
        {
            "action": np.zeros(rows, np.int64),
            "count": np.zeros(rows, np.float32),
            "recurrent_state": {"steps": np.zeros(rows, np.float32)},
            "policy_version": np.zeros(1, np.int64),
            "inference_s": np.zeros(1, np.float32),
            "idle_s": np.zeros(1, np.float32),
        }
        for rows in (2, 1)
    ]
    starts = [torch.tensor([False, True]), torch.tensor([False])]
    outputs, seconds = act_for_replies(
        counting, torch.randn(3, 4), torch.device("cpu"), fields, None, states, [0, 1], starts, replies
    )
    assert outputs[1].tolist() == [5.0, 0.0, 7.0]  # the second env starts an episode: from the initial state
    assert states.state["steps"].tolist() == [6.0, 1.0, 8.0]
    assert replies[0]["recurrent_state"]["steps"].tolist() == [5.0, 6.0]  # what each env entered the step with
    offset = 0
    for reply in replies:
        offset = write_reply(reply, list(fields), outputs, offset, 7, seconds, 0.5)
    assert offset == 3 and replies[1]["count"].tolist() == [7.0] and replies[1]["policy_version"][0] == 7
    assert replies[1]["idle_s"][0] == 0.5


def test_warm_up_steps_act_uniformly_without_the_policy():
    net = policy()
    uniform = UniformActions(ACTIONS, dict(net.outputs()))
    outputs, _ = act_for_replies(net, torch.randn(64, 4), torch.device("cpu"), dict(net.outputs()), uniform)
    assert set(outputs[0].tolist()) == {0, 1} and not outputs[1].any()  # actions both ways; log_prob zero


def test_a_loaded_policys_act_takes_one_gymnasium_observation_and_a_copy_acts_with_its_own_module():
    loaded = accepts_gymnasium_observations(policy().eval())
    obs = np.full(4, 0.5, np.float32)
    action = loaded.act(obs, deterministic=True)["action"]
    assert isinstance(action, np.ndarray) and action.shape == ()
    twin = copy.deepcopy(loaded)
    with torch.no_grad():
        for param in twin.parameters():
            param.zero_()
    assert twin.act(obs, deterministic=True)["value"] == 0.0
    assert loaded.act(obs, deterministic=True)["value"] != 0.0
