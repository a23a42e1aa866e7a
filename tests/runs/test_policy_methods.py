"""What an algorithm calls on a policy is declared with its signature and called before start: a custom policy whose
forward(obs) PPO cannot call stops with exit 2 and one line naming the class and what to write, before any process
group or run directory exists; ANY_LAG names "tolerates any lag"; when learn raises and then the algorithm's close
raises too, the error line names the first error."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from harness.launch import job_env as _env
from harness.runs import TINY

from spmd_rl.api import ANY_LAG, PolicyMethod, UserError
from spmd_rl.config.loading import load_config
from spmd_rl.envs.vector import probe_env
from spmd_rl.run import contract
from spmd_rl.run.driver import first_error

USER_NETS = '''
"""A user's actor-critics for PPO: the built-in one with forward changed, or evaluate returning a value [B, 1]."""
from spmd_rl.modules.actor_critic import ActorCritic


class ForwardOfObs(ActorCritic):
    """Written like a plain torch module: forward(obs) gives the value. PPO calls policy(obs, action)."""

    def forward(self, obs):
        return self.value(obs)


class ValueColumn(ActorCritic):
    def evaluate(self, obs, action):
        log_prob, entropy, value = super().evaluate(obs, action)
        return log_prob, entropy, value.unsqueeze(-1)
'''

USER_ALGOS = '''
"""A user's PPO whose learn fails, and whose close then fails too (a cleanup that assumed learn had run)."""
from spmd_rl.algorithms.ppo import PPO


class FailingPPO(PPO):
    def learn(self, segment, iteration):
        raise ValueError(f"learn failed at iteration {iteration}")

    def close(self):
        raise RuntimeError("close failed: nothing to flush")
'''


@pytest.fixture  # a few files, written per test: the module's tests need not share a worker
def user_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("user_code")
    (folder / "user_nets.py").write_text(textwrap.dedent(USER_NETS).lstrip())
    (folder / "user_algos.py").write_text(textwrap.dedent(USER_ALGOS).lstrip())
    return folder


def run_main_in(folder: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "spmd_rl.main", "--config", TINY, *args],
        cwd=folder,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )


def check(folder: Path, monkeypatch, *overrides: str) -> None:
    monkeypatch.syspath_prepend(str(folder))
    cfg = load_config(TINY, list(overrides))
    policy_cls, algorithm_cls, _, _ = contract.load_classes(cfg)
    contract.check_policy(cfg, probe_env(cfg.env), policy_cls, algorithm_cls)


def test_a_forward_ppo_cannot_call_is_exit_2_naming_the_class_before_any_group(user_folder, tmp_path):
    run_dir = tmp_path / "run"
    result = run_main_in(user_folder, "policy.class=user_nets:ForwardOfObs", f"run.dir={run_dir}")
    assert result.returncode == 2, result.stderr[-3000:]
    line = result.stderr.strip()
    assert len(line.splitlines()) == 1, result.stderr  # one line, no traceback
    for text in (
        "algo.class 'ppo' calls policy.class 'user_nets:ForwardOfObs'",
        "forward(obs, action) -> (log_prob, entropy, value)",
        "TypeError",
        "define forward(self, obs, action) to return self.evaluate(obs, action)",
    ):
        assert text in line, line
    assert not run_dir.exists()  # every check runs before the run directory (and any process group) exists


def test_a_method_returning_the_wrong_shape_is_named_with_its_signature(user_folder, monkeypatch):
    with pytest.raises(UserError) as error:
        check(user_folder, monkeypatch, "policy.class=user_nets:ValueColumn")
    message = str(error.value)
    assert "policy.class 'user_nets:ValueColumn' as evaluate(obs, action) -> (log_prob, entropy, value)" in message
    assert "returned value with shape (2, 1), not (2,)" in message


def test_the_built_in_policies_pass_and_the_check_leaves_torch_random_state_alone():
    for overrides in ([], ["algo.vtrace=true"], ["algo.class=sac", "env.id=Pendulum-v1"]):
        cfg = load_config(None, overrides)
        policy_cls, algorithm_cls, _, _ = contract.load_classes(cfg)
        assert all(isinstance(method, PolicyMethod) for method in algorithm_cls.policy_methods)
        spec = probe_env(cfg.env)
        policy = contract.build_policy(cfg, spec, policy_cls)
        obs, acted = contract._check_act("policy", policy, dict(policy.outputs()), spec)
        state = torch.get_rng_state()
        contract._check_policy_methods(cfg, policy, algorithm_cls, obs, acted, dict(policy.outputs()))
        assert torch.equal(state, torch.get_rng_state())  # SAC's sample() draws noise: from a forked generator
        contract.check_policy(cfg, spec, policy_cls, algorithm_cls)


def test_a_bare_method_name_is_still_checked_for_presence():
    from spmd_rl.algorithms.ppo import PPO

    class NeedsSomething(PPO):
        policy_methods = ("evaluate", "value", "something")

    cfg = load_config(TINY)
    policy_cls, _, _, _ = contract.load_classes(cfg)
    with pytest.raises(UserError, match=r"calls the policy's something, which policy.class 'actor_critic' lacks"):
        contract.check_policy(cfg, probe_env(cfg.env), policy_cls, NeedsSomething)


def test_any_lag_is_a_named_constant_sac_declares():
    from spmd_rl.algorithms.configs import SACConfig
    from spmd_rl.algorithms.sac import SAC

    assert SAC.schedule(SACConfig()).max_policy_lag == ANY_LAG
    assert "ANY_LAG" in __import__("spmd_rl.api").api.__all__


def test_when_close_fails_after_learn_failed_the_line_names_the_first_error(user_folder, tmp_path):
    result = run_main_in(user_folder, "algo.class=user_algos:FailingPPO", f"run.dir={tmp_path / 'run'}")
    assert result.returncode == 4, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("spmd_rl:")]
    assert len(lines) == 2, result.stderr
    assert "error in user code: ValueError: learn failed at iteration 0 (at " in lines[0], lines[0]
    assert "user_algos.py:7" in lines[0]
    assert "then, while cleaning up: RuntimeError: close failed: nothing to flush" in lines[1], lines[1]
    assert "Traceback" not in result.stderr


def test_first_error_follows_only_unwinding_not_translations():
    try:
        try:
            raise ValueError("first")
        finally:
            raise RuntimeError("during cleanup")  # noqa: B012
    except RuntimeError as exc:
        assert str(first_error(exc)) == "first"
    try:
        try:
            raise ValueError("cause")
        except ValueError as cause:
            raise UserError("translated") from cause
    except UserError as exc:
        assert first_error(exc) is exc
    try:
        try:
            raise ValueError("hidden")
        except ValueError:
            raise UserError("translated") from None
    except UserError as exc:
        assert first_error(exc) is exc
