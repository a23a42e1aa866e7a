"""Recurrent policies: the framework keeps each env's state where acting happens, resets it at episode starts,
carries it across segments and checkpoints, and hands the learner what it needs to replay a sequence exactly.

A counting policy (its state: the steps since the episode began) makes every rule visible in the segments, which a
checking algorithm verifies on every iteration (so a multi-process run proves them by finishing with exit 0).
"""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
import yaml
from harness.launch import ROOT, with_pythonpath
from harness.launch import job_env as _env
from harness.parts import RECURRENT_TINY
from harness.parts import SMALL_CARTPOLE as TINY
from harness.recurrent_plugins import CheckSegments
from harness.runs import assert_same_run, run_main

import spmd_rl
from spmd_rl.api import UserError
from spmd_rl.interfaces.policy import EPISODE_START, initial_state

# -- a policy whose state counts the steps of the episode, and an algorithm that checks the segments (both in
# recurrent_plugins.py) -----------------------------------------------------------------------------------------------

COUNTING = {
    **TINY,
    "policy": {"class": "harness.recurrent_plugins:CountingPolicy"},
    "algo": {"class": "harness.recurrent_plugins:CheckSegments", "num_steps": 16},
    "train": {"total_steps": 16 * 3 * 5},
}


def test_the_state_is_reset_at_episode_starts_and_carried_across_segments(tmp_path):
    CheckSegments.seen.clear()
    run = spmd_rl.train(COUNTING, {"run.dir": str(tmp_path / "run")})
    assert run.finished and len(CheckSegments.seen) == 5
    assert sum(float(s["rollout"][EPISODE_START].sum()) for s in CheckSegments.seen) > 10


def test_counting_resumes_with_its_state(tmp_path):
    """A stop and a resume continue every env's count where the checkpoint left it (CheckSegments checks the
    first state of the segment after the resume against the checkpointed algorithm's last count)."""
    overrides = {"run.dir": str(tmp_path / "run"), "run.stop_after_iterations": 2}
    assert not spmd_rl.train(COUNTING, overrides).finished
    CheckSegments.seen.clear()
    assert spmd_rl.train(COUNTING, overrides).finished
    assert len(CheckSegments.seen) == 3


# -- the built-in recurrent actor-critic and RecurrentPPO -----------------------------------------------------------


@pytest.mark.parametrize("cell", ["gru", "lstm"])
def test_replaying_a_sequence_gives_the_log_probs_acting_gave(cell):
    import gymnasium as gym

    from spmd_rl.modules.recurrent import RecurrentActorCritic, RecurrentActorCriticConfig

    torch.manual_seed(0)
    space = gym.spaces.Box(-1, 1, (3,))
    policy = RecurrentActorCritic(space, gym.spaces.Discrete(2), RecurrentActorCriticConfig(cell=cell))
    steps, envs = 12, 4
    obs = torch.randn(steps, envs, 3)
    starts = torch.rand(steps, envs) < 0.2
    first = {name: torch.randn(envs, *f.shape) for name, f in policy.recurrent_state().items()}
    state, actions, log_probs, values = dict(first), [], [], []
    with torch.no_grad():
        for t in range(steps):  # as the inference server acts: reset where an episode starts, then act
            init = initial_state(policy.recurrent_state(), envs)
            state = {k: torch.where(starts[t].unsqueeze(-1), init[k], v) for k, v in state.items()}
            out, state = policy.act(obs[t], state=state)
            actions.append(out["action"]), log_probs.append(out["log_prob"]), values.append(out["value"])
        replayed, entropy, value = policy.evaluate_sequence(obs, torch.stack(actions), starts, first)
    torch.testing.assert_close(replayed, torch.stack(log_probs), rtol=0, atol=1e-5)
    torch.testing.assert_close(value, torch.stack(values), rtol=0, atol=1e-5)
    assert entropy.shape == (steps, envs)


def test_recurrent_ppo_ratio_is_one_at_the_first_epoch_of_every_iteration(tmp_path):
    run = spmd_rl.train(
        RECURRENT_TINY, {"run.dir": str(tmp_path / "run"), "callbacks": ["harness.recurrent_plugins:FirstRatio"]}
    )
    records = [json.loads(line) for line in (run.dir / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 4
    assert all(r["first_ratio_error"] < 1e-5 for r in records), [r["first_ratio_error"] for r in records]
    assert all(r["minibatch_steps"] == 4 for r in records)


def test_n_iterations_equal_half_then_resume_for_a_recurrent_policy(tmp_path):
    full = spmd_rl.train(RECURRENT_TINY, {"run.dir": str(tmp_path / "full")})
    assert full.finished
    overrides = {"run.dir": str(tmp_path / "split"), "run.stop_after_iterations": 2}
    assert not spmd_rl.train(RECURRENT_TINY, overrides).finished
    assert spmd_rl.train(RECURRENT_TINY, overrides).finished
    assert_same_run(tmp_path / "full", tmp_path / "split")
    state = torch.load(tmp_path / "split" / "checkpoints" / "iter_000000001" / "rank0.pt", weights_only=True)
    assert state["inference_server"]["recurrent_state"]["h"].shape == (3, 8), "the checkpoint holds every env's state"


# -- bad input: exit 2 before any process group ---------------------------------------------------------------------


def test_a_state_shaped_otherwise_than_declared_is_a_user_error(tmp_path):
    config = {**COUNTING, "policy": {"class": "harness.recurrent_plugins:WrongStatePolicy"}}
    with pytest.raises(UserError, match=r"returned the state 'h' as \(2, 3\) torch.float32.*declares h \(4,\)"):
        spmd_rl.train(config, {"run.dir": str(tmp_path / "run")})


def test_a_recurrent_policy_needs_an_algorithm_that_replays_sequences_and_back(tmp_path):
    with pytest.raises(UserError, match="declares a recurrent state, but algo.class 'ppo' learns from single steps"):
        counting = {**TINY, "policy": {"class": "harness.recurrent_plugins:CountingPolicy"}}
        spmd_rl.train(counting, {"run.dir": str(tmp_path)})
    stateless = {**RECURRENT_TINY, "policy": {"class": "actor_critic"}}
    with pytest.raises(UserError, match=r"needs the step field\(s\) \['episode_start', 'recurrent_state'\]"):
        spmd_rl.train(stateless, {"run.dir": str(tmp_path / "b")})


def run_here(*args, nproc: int = 0, timeout: float = 120) -> subprocess.CompletedProcess:
    """`python -m spmd_rl.main` (under torchrun with nproc) with this folder importable: its plug-ins are here."""
    env = with_pythonpath(_env(), ROOT / "tests")
    return run_main(*args, nproc=nproc, timeout=timeout, env=env)


def counting_config(tmp_path) -> str:
    """COUNTING as a YAML file, for runs started from the command line."""
    path = tmp_path / "counting.yaml"
    path.write_text(yaml.safe_dump({**COUNTING, "dist": {"timeout_s": 60}}))
    return str(path)


def test_a_bad_declared_state_exits_2_with_one_line(tmp_path):
    result = run_here(
        "--config",
        counting_config(tmp_path),
        "policy.class=harness.recurrent_plugins:WrongStatePolicy",
        f"run.dir={tmp_path / 'run'}",
    )
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "recurrent_state() declares h (4,) float32" in lines[0], lines


# -- other layouts and the async engine ------------------------------------------------------------------------------

SPLIT4 = ["layout.mode=split", "layout.trainer=1", "layout.inference=1", "layout.env=2"]
LAYOUTS = {  # name: (processes, overrides)
    "colocated-2": (2, []),
    "split-4": (4, SPLIT4),
    "async-lag-0": (4, [*SPLIT4, "engine.class=async"]),
    "async-lag-2": (4, [*SPLIT4, "engine.class=async", "engine.max_policy_lag=2"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_state_rules_hold_in_every_layout_and_engine(tmp_path, layout):
    nproc, overrides = LAYOUTS[layout]
    result = run_here(
        "--config",
        counting_config(tmp_path),
        "train.total_steps=384",
        *overrides,
        f"run.dir={tmp_path / 'run'}",
        nproc=nproc,
    )
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["colocated-2", "split-4"])
def test_n_iterations_equal_half_then_resume_for_a_recurrent_policy_in_several_ranks(tmp_path, layout):
    """RecurrentPPO through DDP (colocated 2) and with the state on an inference rank (split 4)."""
    nproc, overrides = LAYOUTS[layout]
    config = tmp_path / "recurrent.yaml"
    config.write_text(yaml.safe_dump({**RECURRENT_TINY, "dist": {"timeout_s": 60}}))
    args = ["--config", str(config), *overrides, "env.num_envs=2", "train.total_steps=256"]  # 4 iterations
    full = run_here(*args, f"run.dir={tmp_path / 'full'}", nproc=nproc)
    assert full.returncode == 0, full.stderr[-3000:]
    stop = [*args, f"run.dir={tmp_path / 'split'}", "run.stop_after_iterations=2"]
    assert run_here(*stop, nproc=nproc).returncode == 75
    resumed = run_here(*stop, nproc=nproc)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_run(tmp_path / "full", tmp_path / "split")


# -- evaluation: the state is kept per env and starts afresh with every episode --------------------------------------


def test_evaluation_carries_the_state_and_resets_it_at_every_episode_start():
    import gymnasium as gym
    from harness.recurrent_plugins import CountingPolicy

    from spmd_rl.config import load_config
    from spmd_rl.run.evaluation import evaluate

    class RecordingCounter(CountingPolicy):
        counts: list = []

        def act(self, obs, deterministic=False, state=None):
            out, next_state = super().act(obs, deterministic, state)
            self.counts.append(int(out["count"][0]))
            return out, next_state

    env_cfg = load_config(None, ["env.num_envs=1"]).env
    policy = RecordingCounter(gym.spaces.Box(-5, 5, (4,)), gym.spaces.Discrete(2), None)
    result = evaluate(policy, env_cfg, episodes=3, seed=0, deterministic=True)
    runs, run = [], []
    for count in policy.counts:
        if count == 0 and run:
            runs.append(run)
            run = []
        run.append(count)
    runs.append(run)
    first, second, third = result["lengths"]
    # each episode acts from counts 0..L-1, then once more on its last observation (the action the reset ignores)
    assert runs == [list(range(first + 1)), list(range(second + 1)), list(range(third))]


def test_a_trained_recurrent_policy_evaluates_during_training_and_after(tmp_path):
    run = spmd_rl.train(RECURRENT_TINY, {"run.dir": str(tmp_path / "run"), "eval.every": 2, "eval.episodes": 2})
    records = [json.loads(line) for line in (run.dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records if "eval_return_mean" in r] == [1, 3]
    import gymnasium as gym

    obs, _ = gym.make("CartPole-v1").reset(seed=0)
    outputs, state = run.policy.act(obs, state=initial_state(run.policy.recurrent_state(), 1))
    assert outputs["action"] in (0, 1) and state["h"].shape == (1, 8)
