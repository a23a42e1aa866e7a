"""Exits that tell the truth: user code that calls sys.exit or os._exit (a policy's constructor or act, an env's
step, a callback), changes its outputs' shape or dtype after the start-up check, returns NaN from act, hangs in
act, or returns a callback result that is no scalar ends a real run with exit 4 and one line naming the user's
file:line or the key, never exit 0 without finished.json (or a traceback). Each case is a real one-process run of
the command line, as a user would start it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from spmd_rl.interfaces.policy import StepField
from spmd_rl.roles.acting import check_act_outputs
from spmd_rl.run.report import callback_scalars
from spmd_rl.runtime.errors import USER_CODE_EXIT_CODE, UserCodeError

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "ci_tiny.yaml")

USER_MODULE = """
import os
import sys
import time

import gymnasium as gym

from spmd_rl.api import Callback
from spmd_rl.modules.actor_critic import ActorCritic

MODE = os.environ["USER_CODE_MODE"]


class Policy(ActorCritic):
    def __init__(self, *args, **kwargs):
        if MODE == "init_exit_3":
            sys.exit(3)  # LINE:init_exit_3
        super().__init__(*args, **kwargs)
        self.acts = 0

    def act(self, obs, deterministic=False):
        self.acts += 1
        late = self.acts > 5  # after the start-up contract check's two calls
        if late and MODE == "act_exit_0":
            sys.exit(0)  # LINE:act_exit_0
        if late and MODE == "act_os_exit_0":
            os._exit(0)  # LINE:act_os_exit_0
        if late and MODE == "act_hangs":
            time.sleep(600)  # LINE:act_hangs
        if deterministic and late and MODE == "eval_hangs":  # training acts stochastically: only evaluation
            time.sleep(600)  # LINE:eval_hangs
        out = super().act(obs, deterministic)
        if late and MODE == "act_shape":
            out["action"] = out["action"][:1]
        if late and MODE == "act_nan":
            out["log_prob"] = out["log_prob"] * float("nan")
        return out


class ExitingCartPole(gym.Wrapper):
    def __init__(self):
        super().__init__(gym.make("CartPole-v1"))
        self.steps = 0

    def step(self, action):
        self.steps += 1
        if self.steps > 5:
            sys.exit(0)  # LINE:env_step_exit_0
        return self.env.step(action)


gym.register("ExitingCartPole-v0", entry_point=ExitingCartPole)


class Hook(Callback):
    def on_iteration_end(self, iteration, metrics, algorithm):
        if MODE == "callback_exit_0":
            sys.exit(0)  # LINE:callback_exit_0
        if MODE == "callback_list":
            return [1.0]
        return {"note": "not a number"}
"""


def _line_of(mode: str, folder: Path) -> str:
    lines = (folder / "user_code.py").read_text().splitlines()
    return f"{folder / 'user_code.py'}:{next(i for i, text in enumerate(lines, 1) if f'LINE:{mode}' in text)}"


@pytest.fixture  # a few files, written per test: the module's tests need not share a worker
def folder(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("user_code")
    (path / "user_code.py").write_text(textwrap.dedent(USER_MODULE).lstrip())
    return path


CASES = {
    # mode: (extra overrides, what the one line must say besides its file:line)
    "init_exit_3": (["policy.class=user_code:Policy"], "sys.exit(3) was called"),
    "act_exit_0": (["policy.class=user_code:Policy"], "sys.exit(0) was called"),
    "act_os_exit_0": (["policy.class=user_code:Policy"], "os._exit(0) was called"),
    # a bound that leaves the user module's own import of torch time on a busy machine
    "act_hangs": (["policy.class=user_code:Policy", "dist.timeout_s=60"], "policy.act did not return within 60 s"),
    "eval_hangs": (
        ["policy.class=user_code:Policy", "dist.timeout_s=60", "eval.every=1"],
        "the evaluation after iteration 0 (10 eval.episodes) did not return within 60 s",
    ),
    "act_shape": (["policy.class=user_code:Policy"], "act() returned 'action' as (1,) torch.int64"),
    # blamed on the policy, not on the update it would poison ("fix the algorithm or its settings")
    "act_nan": (["policy.class=user_code:Policy"], "act() returned NaN in 'log_prob'"),
    "env_step_exit_0": (["env.id=user_code:ExitingCartPole-v0"], "sys.exit(0) was called"),
    "callback_exit_0": (["callbacks=[user_code:Hook]"], "sys.exit(0) was called"),
    "callback_list": (["callbacks=[user_code:Hook]"], "returned a list; return None or a dict of scalars"),
    "callback_string": (["callbacks=[user_code:Hook]"], "returned 'note': str 'not a number'"),
}


HANGS = ("act_hangs", "eval_hangs")  # each waits out its bound: the two run at once, in one test


def _start(folder: Path, tmp_path: Path, mode: str) -> subprocess.Popen:
    overrides, _ = CASES[mode]
    env = dict(os.environ, USER_CODE_MODE=mode, PYTHONPATH=os.pathsep.join([str(folder), str(ROOT)]))
    env.pop("RANK", None)
    return subprocess.Popen(
        [sys.executable, "-m", "spmd_rl.main", "--config", TINY, f"run.dir={tmp_path / mode}", *overrides],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _check_exit_4_and_one_line(folder: Path, tmp_path: Path, mode: str, run: subprocess.Popen) -> None:
    try:
        stdout, stderr = run.communicate(timeout=180)
    finally:
        if run.poll() is None:
            run.kill()
            run.communicate()
    _, says = CASES[mode]
    assert run.returncode == USER_CODE_EXIT_CODE, stdout[-2000:] + stderr[-2000:]
    ours = [line for line in stderr.splitlines() if line.startswith("spmd_rl:") and "note:" not in line]
    assert len(ours) == 1 and "Traceback" not in stderr, stderr
    assert says in ours[0], ours[0]
    if "LINE:" + mode in (folder / "user_code.py").read_text():
        assert _line_of(mode, folder) in ours[0], ours[0]
    assert not (tmp_path / mode / "finished.json").exists()


@pytest.mark.parametrize("mode", [mode for mode in CASES if mode not in HANGS])
def test_user_code_that_exits_or_breaks_its_contract_ends_the_run_with_exit_4_and_one_line(folder, tmp_path, mode):
    _check_exit_4_and_one_line(folder, tmp_path, mode, _start(folder, tmp_path, mode))


@pytest.mark.slow
def test_user_code_that_hangs_in_act_or_in_evaluation_ends_the_run_with_exit_4_and_one_line(folder, tmp_path):
    runs = {mode: _start(folder, tmp_path, mode) for mode in HANGS}  # both wait out their bound at the same time
    try:
        for mode, run in runs.items():
            _check_exit_4_and_one_line(folder, tmp_path, mode, run)
    finally:
        for run in runs.values():
            if run.poll() is None:
                run.kill()
                run.communicate()


def test_the_per_step_check_names_the_key_and_passes_outputs_as_declared():
    fields = {"action": StepField((), torch.int64), "log_prob": StepField((), torch.float32)}
    policy = torch.nn.Linear(1, 1)
    check_act_outputs(policy, {"action": torch.zeros(3, dtype=torch.int64), "log_prob": torch.zeros(3)}, fields, 3)
    with pytest.raises(UserCodeError, match="'log_prob' as \\(3,\\) torch.float64"):
        check_act_outputs(
            policy, {"action": torch.zeros(3, dtype=torch.int64), "log_prob": torch.zeros(3).double()}, fields, 3
        )
    with pytest.raises(UserCodeError, match="'log_prob' as nothing"):
        check_act_outputs(policy, {"action": torch.zeros(3, dtype=torch.int64)}, fields, 3)
    masked = torch.tensor([0.0, -float("inf"), 1.0])  # an infinity is a value a policy may mean (a masked logit)
    check_act_outputs(policy, {"action": torch.zeros(3, dtype=torch.int64), "log_prob": masked}, fields, 3)
    with pytest.raises(UserCodeError, match="act\\(\\) returned NaN in 'log_prob'"):
        check_act_outputs(
            policy, {"action": torch.zeros(3, dtype=torch.int64), "log_prob": torch.full((3,), float("nan"))}, fields, 3
        )


def test_callback_scalars_take_numbers_of_every_kind():
    import numpy as np

    got = callback_scalars("m:C", 0, {"a": 1, "b": np.float32(2.5), "c": torch.tensor(3.0), "d": True})
    assert got == {"a": 1.0, "b": 2.5, "c": 3.0, "d": 1.0}
    assert callback_scalars("m:C", 0, None) == {} and callback_scalars("m:C", 0, {}) == {}
