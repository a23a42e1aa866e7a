"""Plug-ins for tests/launchers/test_recurrent.py, in a module of their own so that runs started from the command line
import only this (named as harness.recurrent_plugins:Class with tests/ importable)."""

from __future__ import annotations

import torch

from spmd_rl.api import ANY_LAG, EPISODE_START, RECURRENT_STATE, Algorithm, Callback, Policy, Schedule, StepField


class CountingPolicy(Policy):
    """Always pushes left (CartPole episodes end within ~10 steps); its state counts the steps since the episode
    began, and it reports the count it acted from as the per-step output `count`."""

    def __init__(self, observation_space, action_space, config):
        super().__init__(observation_space, action_space, config)
        self.unused = torch.nn.Linear(1, 1)  # something to ship and to optimize

    def outputs(self):
        return {"action": StepField((), torch.int64), "count": StepField((), torch.float32)}

    def recurrent_state(self):
        return {"steps": StepField((), torch.float32)}

    def act(self, obs, deterministic=False, state=None):
        count = state["steps"]
        return {"action": torch.zeros(obs.shape[0], dtype=torch.int64), "count": count.clone()}, {"steps": count + 1}


class CheckSegments(Algorithm):
    """Learns nothing; raises (exit 4) when a segment breaks a rule of the recurrent contract."""

    requires = ("count", EPISODE_START, RECURRENT_STATE)
    seen: list = []  # one process: what the tests look at

    @classmethod
    def schedule(cls, config):
        return Schedule(max_policy_lag=ANY_LAG)  # it learns nothing: any lag (the async engine's lag 2 case)

    def __init__(self, policy, config, context):
        super().__init__(policy, config, context)
        self.previous_last = None  # each column's count at the last step of the previous segment

    def learn(self, segment, iteration):
        rollout = segment["rollout"]
        count, start, valid = rollout["count"], rollout[EPISODE_START], rollout["valid"]
        first = segment[RECURRENT_STATE]["steps"]
        # The first step acts from the recorded state, reset where an episode starts.
        assert torch.equal(count[0], torch.where(start[0], 0.0, first)), (iteration, count[0], first)
        # Within a segment: +1 a step, 0 at an episode start; an episode starts right after a reset step.
        assert torch.equal(count[1:], torch.where(start[1:], 0.0, count[:-1] + 1))
        assert torch.equal(start[1:], ~valid[:-1])
        # Across segments: the state carries on from where the previous segment left it.
        if self.previous_last is not None:
            assert torch.equal(first, self.previous_last + 1), (first, self.previous_last)
        else:
            assert iteration > 0 or bool(start[0].all()), "the run's first step starts every episode"
        assert bool(start[1:].any()), "no episode ended inside a segment: the test checks too little"
        self.previous_last = count[-1].clone()
        CheckSegments.seen.append(segment.clone())
        return {"episode_starts": float(start.sum())}

    def state_dict(self):
        return {"previous_last": self.previous_last}

    def load_state_dict(self, state):
        self.previous_last = state["previous_last"]


class FirstRatio(Callback):
    """Logs RecurrentPPO's first minibatch ratio (|ratio - 1| at its largest): the replay against acting."""

    def on_iteration_end(self, iteration, metrics, algorithm):
        return {"first_ratio_error": algorithm.first_ratio}


class WrongStatePolicy(CountingPolicy):
    """Declares a state of 4 per env but returns 3."""

    def recurrent_state(self):
        return {"h": StepField((4,), torch.float32)}

    def act(self, obs, deterministic=False, state=None):
        out = {"action": torch.zeros(obs.shape[0], dtype=torch.int64), "count": torch.zeros(obs.shape[0])}
        return out, {"h": torch.zeros(obs.shape[0], 3)}
