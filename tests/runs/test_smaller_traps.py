"""Smaller traps, as a user meets them: a passed --dry-run leaves no temporary directory behind; evaluation ends
every episode after --max-steps steps (default: the env's own limit, else a bound), so a policy that never ends an
episode cannot evaluate forever; `evaluate RUN/checkpoints/latest` works."""

from __future__ import annotations

import json
import subprocess
import sys

import gymnasium as gym
import numpy as np
import pytest
from harness.launch import ROOT
from harness.launch import job_env as _env
from harness.runs import TINY

import spmd_rl
from spmd_rl.config.loading import load_config
from spmd_rl.config.plugins import POLICY, load_class
from spmd_rl.envs.vector import probe_env
from spmd_rl.evaluate import evaluate, main
from spmd_rl.run import evaluation
from spmd_rl.run.policies import build_policy


class Endless(gym.Env):
    """An episode that never ends, whatever the policy does (no termination, no time limit registered)."""

    observation_space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(2, np.float32), {}

    def step(self, action):
        return np.zeros(2, np.float32), 1.0, False, False, {}


@pytest.fixture(scope="module")
def endless():
    if "Endless-v0" not in gym.registry:
        gym.register(id="Endless-v0", entry_point=Endless)  # no max_episode_steps
    cfg = load_config(None, ["env.id=Endless-v0", "env.num_envs=2"])
    return build_policy(cfg, probe_env(cfg.env), load_class(POLICY, cfg.classes["policy"])), cfg


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    return spmd_rl.train(TINY, {"run.dir": tmp_path_factory.mktemp("traps") / "tiny"}).dir


def test_a_passed_dry_run_removes_its_temporary_directory(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "spmd_rl.main", "--config", TINY, "--dry-run"],
        cwd=ROOT,
        env={**_env(), "TMPDIR": str(tmp_path)},  # where tempfile makes the dry run's directory
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "spmd_rl: dry run passed: one iteration in the real layout" in result.stdout
    assert "iter     0" in result.stdout  # it ran an iteration, in a directory under TMPDIR ...
    assert list(tmp_path.iterdir()) == []  # ... which is gone


def test_an_episode_that_never_ends_is_cut_at_max_steps(endless):
    policy, cfg = endless
    result = evaluate(policy, cfg.env, episodes=3, seed=0, deterministic=True, max_steps=25)
    assert result["lengths"] == [25, 25, 25] and result["returns"] == [25.0, 25.0, 25.0]
    assert result["max_steps"] == 25 and result["cut"] == 3


def test_without_max_steps_the_bound_is_the_envs_limit_else_a_default(endless, monkeypatch):
    assert evaluation.episode_step_limit(load_config(None).env) == 500  # CartPole-v1's registration
    assert evaluation.episode_step_limit(load_config(None, ["env.kwargs={max_episode_steps: 50}"]).env) == 50
    policy, cfg = endless
    assert evaluation.episode_step_limit(cfg.env) is None
    monkeypatch.setattr(evaluation, "DEFAULT_MAX_STEPS", 40)  # 100000 by default: too long for a test
    result = evaluate(policy, cfg.env, episodes=2, seed=0, deterministic=False)
    assert result["lengths"] == [40, 40] and result["max_steps"] == 40 and result["cut"] == 2


def test_the_command_line_takes_max_steps_and_checkpoints_latest(tiny_run, capsys):
    assert main([str(tiny_run), "--episodes", "4", "--max-steps", "5", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["max_steps"] == 5 and all(length <= 5 for length in report["lengths"])
    assert main([str(tiny_run), "--episodes", "4", "--max-steps", "5"]) == 0
    assert "cut at 5 steps" in capsys.readouterr().out
    assert main([str(tiny_run), "--max-steps", "0"]) == 2
    assert "--max-steps 0: allow at least 1 step" in capsys.readouterr().err

    latest = tiny_run / "checkpoints" / "latest"
    assert latest.is_file()
    assert main([str(latest), "--episodes", "2", "--json"]) == 0, capsys.readouterr().err
    assert json.loads(capsys.readouterr().out)["episodes"] == 2
