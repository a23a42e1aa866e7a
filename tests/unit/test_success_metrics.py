"""Success, measured (envs/success.py, run/metrics.py, run/evaluation.py): which envs report it, each episode's
success at any step and at its end under NEXT_STEP autoreset, the rates per iteration and env group, the Wilson
interval, and an explicit key the info lacks."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from harness import instructed_env  # noqa: F401  (registers Instructed-v0)

from spmd_rl.config.loading import load_config
from spmd_rl.envs.success import EpisodeSuccess
from spmd_rl.envs.vector import probe_env
from spmd_rl.run.evaluation import wilson_interval
from spmd_rl.run.metrics import success_rates
from spmd_rl.runtime.errors import UserError

ENV = "env.id=tests.harness.instructed_env:Instructed-v0"


def test_the_probe_learns_which_envs_report_success():
    assert probe_env(load_config(None, [ENV]).env).success_key == "success"
    assert probe_env(load_config(None, [ENV, "env.kwargs={success_key: is_success}"]).env).success_key is None
    named = load_config(None, [ENV, "env.kwargs={success_key: is_success}", "env.success_key=is_success"])
    assert probe_env(named.env).success_key == "is_success"
    assert probe_env(load_config(None, []).env).success_key is None  # CartPole: no success metrics


def test_a_key_the_user_named_must_be_in_the_info():
    with pytest.raises(UserError, match=r"env.success_key=is_success: env 'CartPole-v1' has no such key"):
        probe_env(load_config(None, ["env.success_key=is_success"]).env)


def test_success_at_any_step_and_at_the_end_under_next_step_autoreset():
    success = EpisodeSuccess("success", 3)
    never = np.zeros(3, dtype=bool)
    valid = np.ones(3, dtype=bool)

    def step(flags, done, valid=valid):
        info = {"success": np.array(flags), "_success": np.ones(3, dtype=bool)}
        return [a.tolist() for a in success.step(info, np.array(valid), np.array(done))]

    assert step([True, False, False], never) == [[False] * 3, [False] * 3]  # nothing ended yet
    # env 0 succeeded earlier but not at its end; env 1 succeeds at its last step; env 2 never did.
    assert step([False, True, False], [True, True, True]) == [[True, True, False], [False, True, False]]
    # The reset step after an episode's end (invalid) reports the reset's info: it counts for no episode.
    assert step([True, True, True], never, valid=[False] * 3) == [[False] * 3, [False] * 3]
    assert step([False, False, False], [True, False, False]) == [[False, False, False], [False] * 3]
    # An env that reports nothing this step (its `_success` mask False) did not succeed then.
    masked = {"success": np.array([True, True, True]), "_success": np.array([False, True, False])}
    assert success.step(masked, valid, np.ones(3, dtype=bool))[0].tolist() == [False, True, False]


def test_rates_per_iteration_and_per_group():
    statistics = {
        "successes": torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=torch.float64),
        "successes_at_end": torch.tensor([0.0, 0.0, 1.0, 1.0], dtype=torch.float64),
        "groups": torch.tensor([0.0, 0.0, 1.0, 1.0], dtype=torch.float64),
    }
    rates = success_rates(statistics, ["near", "far"])
    assert rates == {
        "success_rate": 0.75,
        "success_at_end_rate": 0.5,
        "success_rate/near": 0.5,
        "success_at_end_rate/near": 0.0,
        "success_rate/far": 1.0,
        "success_at_end_rate/far": 1.0,
    }
    empty = {"successes": torch.zeros(0, dtype=torch.float64), "successes_at_end": torch.zeros(0, dtype=torch.float64)}
    assert all(math.isnan(value) for value in success_rates(empty, []).values())  # no episode ended: null
    assert success_rates({"returns": torch.zeros(2)}, []) == {}  # an env without a success flag: no keys


def test_the_wilson_interval():
    low, high = wilson_interval(8, 10)
    assert (round(low, 3), round(high, 3)) == (0.490, 0.943)
    assert wilson_interval(0, 10)[0] == 0.0 and 0.27 < wilson_interval(0, 10)[1] < 0.28
    assert wilson_interval(20, 20)[1] == 1.0 and round(wilson_interval(20, 20)[0], 3) == 0.839


def test_an_algorithm_may_require_the_success_fields_of_an_env_that_reports_them():
    from spmd_rl.algorithms.ppo import PPO
    from spmd_rl.run import contract

    class LearnsFromSuccess(PPO):
        requires = (*PPO.requires, "episode_success", "episode_success_at_end")

    cfg = load_config(None, [ENV])
    policy_cls, _, _, _ = contract.load_classes(cfg)
    contract.check_policy(cfg, probe_env(cfg.env), policy_cls, LearnsFromSuccess)
    cartpole = load_config(None, [])
    with pytest.raises(UserError, match=r"only for an env whose step info has a success flag; env 'CartPole-v1'"):
        contract.check_policy(cartpole, probe_env(cartpole.env), policy_cls, LearnsFromSuccess)
