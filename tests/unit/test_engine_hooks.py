"""Engines extended by subclassing SyncEngine's hooks, and the policy-lag hint said by the algorithm (its
check_plan), so that no engine names an algorithm's knob."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch

import spmd_rl
from spmd_rl.algorithms.configs import PPOConfig
from spmd_rl.algorithms.ppo import PPO
from spmd_rl.api import SyncEngine, UserError
from spmd_rl.engines.asynchronous import AsyncEngine
from spmd_rl.engines.asynchronous.config import AsyncEngineConfig
from spmd_rl.interfaces.algorithm import PlanFacts

ENGINES = Path(__file__).resolve().parents[2] / "spmd_rl" / "engines"
CALLS: list = []


class Count:
    """A component of the engine's own: its number is saved in every checkpoint and loaded back on resume."""

    def __init__(self):
        self.value = 0

    def state_dict(self):
        return {"value": torch.tensor(self.value)}

    def load_state_dict(self, state):
        self.value = int(state["value"])


class HookedEngine(SyncEngine):
    """Records its hooks and keeps a number of its own in every checkpoint."""

    def components(self, run):
        self.count = Count()
        return {"hooked": self.count}

    def after_learn(self, run, trainer, iteration, metrics, logger):
        CALLS.append(("after_learn", iteration))
        self.count.value += 1
        return {**metrics, "hooked": float(iteration), "count": float(self.count.value)}

    def before_sync(self, run, trainer, iteration):
        CALLS.append(("before_sync", iteration))


def tiny_config(engine: str, iterations: int) -> dict:
    """PPO on CartPole in one process, 16 env steps an iteration, with engine.class this module's `engine`."""
    return {
        "env": {"num_envs": 2},
        "engine": {"class": f"test_engine_hooks:{engine}"},
        "algo": {"num_steps": 8, "num_minibatches": 2, "update_epochs": 1},
        "train": {"total_steps": 16 * iterations},
        "log": {"progress": False, "tensorboard": False},
    }


def test_a_subclass_hooks_into_the_sync_loops_and_extends_the_checkpoint(tmp_path):
    config = tiny_config("HookedEngine", iterations=3)
    CALLS.clear()
    run = spmd_rl.train(config, {"run.dir": str(tmp_path / "run"), "run.stop_after_iterations": 2})
    assert not run.finished
    # PPO syncs after every iteration: both hooks once per iteration, after_learn first.
    assert CALLS == [("after_learn", 0), ("before_sync", 0), ("after_learn", 1), ("before_sync", 1)]
    state = torch.load(tmp_path / "run" / "checkpoints" / "iter_000000001" / "rank0.pt", weights_only=True)
    assert int(state["hooked"]["value"]) == 2 and {"trainer", "report", "env_runner"} <= set(state)
    assert spmd_rl.train(config, {"run.dir": str(tmp_path / "run")}).finished
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["hooked"] for r in records] == [0.0, 1.0, 2.0]
    assert [r["count"] for r in records] == [1.0, 2.0, 3.0], "the resumed run counts on from the checkpoint"


def test_the_earlier_checkpoint_state_hook_warns_and_its_state_is_still_saved(tmp_path):
    """SyncEngine.checkpoint_state, replaced by components(run), is a deprecated alias for one release: an override
    warns when its class is made, and what it adds is in every checkpoint, under 'checkpoint_state'."""
    with pytest.warns(DeprecationWarning, match="overrides SyncEngine.checkpoint_state.*components"):

        class Earlier(SyncEngine):
            def checkpoint_state(self, trainer=None, report=None, runner=None, server=None):
                assert trainer is not None and report is not None and runner is not None and server is not None
                return {**super().checkpoint_state(trainer, report, runner, server), "mine": torch.tensor(7)}

    globals()["Earlier"] = Earlier  # engine.class names it by module:Class
    assert spmd_rl.train(tiny_config("Earlier", iterations=2), {"run.dir": str(tmp_path / "run")}).finished
    state = torch.load(tmp_path / "run" / "checkpoints" / "iter_000000001" / "rank0.pt", weights_only=True)
    assert state["checkpoint_state"] == {"mine": torch.tensor(7)} and "trainer" in state


def _facts(asked):
    return PlanFacts(1, 1, 64, 64, 3, asked_policy_lag=asked)


def test_the_vtrace_hint_comes_from_the_algorithms_check_plan():
    assert AsyncEngine.asked_policy_lag(AsyncEngineConfig(max_policy_lag=2)) == 2
    with pytest.raises(UserError, match=r"tolerates \(0\).*set algo.vtrace=true"):
        PPO.check_plan(PPOConfig(), _facts(2))
    PPO.check_plan(PPOConfig(vtrace=True), _facts(2))
    PPO.check_plan(PPOConfig(), _facts(0))
    PPO.check_plan(PPOConfig(), _facts(None))


def test_no_engine_reads_an_algorithms_knob():
    """cfg.algo goes whole to the algorithm's own class methods; an engine reads none of its fields."""
    found = []
    for path in ENGINES.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and node.value.attr == "algo":
                found.append(f"{path.name}:{node.lineno} .algo.{node.attr}")
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "hasattr":
                if any(isinstance(a, ast.Attribute) and a.attr == "algo" for a in node.args):
                    found.append(f"{path.name}:{node.lineno} hasattr(.algo)")
    assert found == []


def test_an_engine_that_resumes_without_restoring_or_with_a_capture_function_stops_with_one_line():
    """Builders no longer restore: an engine of its own loops that skips run.restore would go on from fresh state."""
    from types import SimpleNamespace

    from spmd_rl.run.run import Run

    run = SimpleNamespace(
        cfg=SimpleNamespace(classes={"engine": "my_loops:Mine"}),
        resume=SimpleNamespace(checkpoint="runs/x/checkpoints/iter_000000003"),
        _restored=False,
        describe=lambda: "rank 0 (trainer 0)",
    )
    with pytest.raises(UserError, match=r"'my_loops:Mine' passes a capture function to run.end_iteration"):
        Run.end_iteration(run, 3, lambda: {})  # type: ignore[arg-type]
    with pytest.raises(UserError, match=r"never called run.restore\(components\) on rank 0 \(trainer 0\)"):
        Run.end_iteration(run, 3, {})  # type: ignore[arg-type]
