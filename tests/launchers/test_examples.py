"""The examples in examples/, run as a user would: each folder copied somewhere else, `python -m spmd_rl.main
--config <its yaml>` from inside the copy (its modules found in the working directory), in one process, colocated
2 ranks and split 4 ranks. Short budgets: these prove the wiring; benchmarks/examples.py measures the learning.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from harness.launch import ROOT
from harness.launch import job_env as _env
from harness.runs import PPO_METRICS, assert_run_complete, run_main

EXAMPLES = ROOT / "examples"

# name: (config file, overrides for a few iterations, env steps per iteration per env rank, the algorithm's metrics).
# Each env steps at least 50 times, so some CartPole episode ends (metrics hold returns) in every layout; on
# Pendulum-v1 (200-step episodes) at least 256 times.
CASES = {
    "pixel_catch": ("catch.yaml", ["env.num_envs=4", "algo.num_steps=8", "train.total_steps=256"], 32, PPO_METRICS),
    "a2c": (
        "a2c_cartpole.yaml",
        ["env.num_envs=2", "algo.num_steps=5", "train.total_steps=200"],
        10,
        {"policy_loss", "value_loss", "entropy"},
    ),
    "recurrent_cartpole": (
        "my_gru.yaml",
        ["env.num_envs=2", "algo.num_steps=25", "train.total_steps=200"],
        50,
        PPO_METRICS,
    ),
    "heldout_eval": (
        "heldout_pendulum.yaml",
        [
            "env.num_envs=2",
            "algo.num_steps=64",
            "algo.num_minibatches=2",
            "algo.update_epochs=2",
            "engine.every=3",
            "engine.episodes=2",
            "train.total_steps=1024",
        ],
        128,
        PPO_METRICS,
    ),
    "torch_cartpole": (
        "torch_cartpole.yaml",
        ["env.num_envs=4", "algo.num_steps=16", "algo.num_minibatches=2", "train.total_steps=256"],
        64,
        PPO_METRICS,
    ),
    # GRPO with chunks of 4 and groups of 8: 8 envs (one group) x 2 decisions x 4 steps per env rank an iteration.
    "instructed_reach": (
        "grpo.yaml",
        ["env.num_envs=8", "env.max_episode_steps=8", "train.total_steps=256"],
        64,
        {"outcome_mean", "dropped_group_fraction", "minibatch_steps", "success_rate"},
    ),
}
# layout: (torchrun processes (0 = plain python), env ranks, overrides)
LAYOUTS = {
    "one_process": (0, 1, []),
    "colocated2": (2, 2, []),
    "split4": (
        4,
        2,
        ["layout.mode=split", "layout.trainer=1", "layout.inference=1", "layout.env=2", "weights.verify_every=1"],
    ),
}


def copy_example(name: str, tmp_path: Path) -> Path:
    folder = tmp_path / f"my_{name}"
    shutil.copytree(EXAMPLES / name, folder, ignore=shutil.ignore_patterns("__pycache__", "runs"))
    return folder


def run_in(folder: Path, args: list[str], nproc: int = 0, timeout: float = 240) -> subprocess.CompletedProcess:
    # One process starts the real command (launcher "none"): these test `python -m spmd_rl.main` run as a user runs
    # it from the example's folder, its modules found there; ranks are forked (harness/forked.py).
    launcher = "forked" if nproc else "none"
    return run_main(*args, nproc=nproc, timeout=timeout, cwd=folder, env=_env(), launcher=launcher)


@pytest.mark.parametrize(
    "layout", [pytest.param(name, marks=[pytest.mark.slow] if ranks else []) for name, (ranks, *_) in LAYOUTS.items()]
)
@pytest.mark.parametrize("name", CASES)
def test_example_runs_from_a_copy_of_its_folder(name, layout, tmp_path):
    config, overrides, steps_per_env_rank, algo_metrics = CASES[name]
    nproc, env_ranks, layout_overrides = LAYOUTS[layout]
    folder = copy_example(name, tmp_path)
    run_dir = tmp_path / "run"
    result = run_in(
        folder,
        ["--config", config, *overrides, *layout_overrides, f"run.dir={run_dir}", "log.progress=false"],
        nproc=nproc,
    )
    total_steps = int(overrides[-1].partition("=")[2])
    records = assert_run_complete(
        result, run_dir, iterations=total_steps // (steps_per_env_rank * env_ranks), algo_metrics=algo_metrics
    )
    assert records[-1]["env_steps"] == total_steps
    assert records[-1]["episodes"] > 0
    CHECKS.get(name, lambda records: None)(records)


def heldout_only_before_every_third_sync(records: list[dict]) -> None:
    # engine.every=3 with PPO (weights synced after every iteration): held-out episodes after iterations 2, 5, ...
    # on the metrics rank, and on no other iteration.
    heldout = {r["iteration"]: r["heldout_return_mean"] for r in records if "heldout_return_mean" in r}
    assert list(heldout) == [i for i in range(len(records)) if (i + 1) % 3 == 0]
    assert all(-3300 < value <= 0 for value in heldout.values())  # Pendulum-v1: >= -16.3 a step, 200 steps


# name: what its metrics hold beyond every example's
CHECKS = {"heldout_eval": heldout_only_before_every_third_sync}


# ---------------------------------------------------------------------------------------------------------------
# The examples' own pieces


@pytest.fixture
def example_modules(monkeypatch):
    for name in CASES:
        monkeypatch.syspath_prepend(str(EXAMPLES / name))


def test_catch_pays_one_at_the_bottom_row_and_draws_ball_and_paddle(example_modules):
    import catch_env
    import gymnasium as gym
    import numpy as np

    env = gym.make("catch_env:Catch-v0", rows=10, columns=5)
    obs, _ = env.reset(seed=3)
    assert obs.shape == (10, 5, 1) and obs.dtype == np.uint8 and (obs > 0).sum() == 2
    ball_column = int(np.flatnonzero(obs[0, :, 0])[0])
    paddle = 2
    for step in range(9):
        action = (
            catch_env.STAY if paddle == ball_column else (catch_env.LEFT if paddle > ball_column else catch_env.RIGHT)
        )
        paddle += action - catch_env.STAY
        obs, reward, terminated, truncated, _ = env.step(action)
        assert terminated == (step == 8) and not truncated
    assert reward == 1.0 and obs[9, ball_column, 0] == 255


def test_instructed_reach_succeeds_only_at_the_named_target_and_blanking_hides_it(example_modules):
    import gymnasium as gym
    import numpy as np
    import reach_env

    def steer_to(env, colour):
        obs, reward, terminated, info = None, 0.0, False, {}
        while not terminated:
            place = np.array(reach_env.TARGETS[colour][0])
            obs, reward, terminated, truncated, info = env.step((place - env.unwrapped.arm) / env.unwrapped.speed)
            assert not truncated
        return obs, reward, info

    env = gym.make("reach_env:InstructedReach-v0")
    obs, _ = env.reset(seed=0)
    named = obs["instruction"].split()[2]
    assert obs["instruction"] == f"reach the {named} target" and env.observation_space.contains(obs)
    # The image draws each target in its colour, and the arm.
    assert all((obs["image"] == colour).all(-1).sum() == 4 for _, colour in reach_env.TARGETS.values())
    _, reward, info = steer_to(env, named)
    assert reward == 1.0 and info["success"]
    obs, _ = env.reset(seed=0)
    other = next(colour for colour in reach_env.TARGETS if colour != named)
    _, reward, info = steer_to(env, other)  # another target ends the episode, as a failure
    assert reward == 0.0 and not info["success"]
    blanked = gym.make("reach_env:InstructedReach-v0", blank_instruction=True)
    assert {blanked.reset(seed=seed)[0]["instruction"] for seed in range(10)} == {"reach the target"}


def test_a2c_returns_stop_at_terminations_and_bootstrap_truncations(example_modules):
    from a2c import n_step_returns

    gamma = 0.5
    # One env, 4 steps: step 0 terminates, step 1 is the reset step, step 2 is truncated (step 3 records V(final
    # obs) = 8), and the rollout ends after step 3 with V(next obs) = 4.
    reward = torch.tensor([[1.0], [0.0], [2.0], [3.0]])
    value = torch.tensor([[5.0], [6.0], [7.0], [8.0]])
    terminated = torch.tensor([[True], [False], [False], [False]])
    truncated = torch.tensor([[False], [False], [True], [False]])
    returns = n_step_returns(reward, value, torch.tensor([4.0]), terminated, truncated, gamma)
    assert returns[0].item() == 1.0  # no bootstrap past a termination
    assert returns[2].item() == 2.0 + gamma * 8.0  # bootstrap from V(final obs), not from the reset step's return
    assert returns[3].item() == 3.0 + gamma * 4.0  # bootstrap from V(next obs)


def test_heldout_env_lays_its_settings_over_the_training_env_kwargs_and_refuses_unknown_ones(example_modules):
    import types

    import gymnasium as gym
    from heldout_engine import HeldOutEvalConfig, HeldOutEvalEngine, heldout_env

    from spmd_rl.api import UserError
    from spmd_rl.config import EnvSection

    training = EnvSection(id="Pendulum-v1", num_envs=4, kwargs={"g": 10.0, "max_episode_steps": 50})
    heldout = heldout_env(training, {"g": 12.0})
    assert heldout.kwargs == {"g": 12.0, "max_episode_steps": 50} and heldout.num_envs == 4
    assert training.kwargs == {"g": 10.0, "max_episode_steps": 50}  # the training envs keep theirs
    assert gym.make(heldout.id, **heldout.kwargs).unwrapped.g == 12.0
    # Refused before any rank starts (check_plan), not at the first evaluation.
    HeldOutEvalEngine.check_plan(
        types.SimpleNamespace(env=training, engine=HeldOutEvalConfig(kwargs={"g": 12.0})), None, None, None
    )
    with pytest.raises(UserError, match="engine.kwargs .*'gravity'"):
        HeldOutEvalEngine.check_plan(
            types.SimpleNamespace(env=training, engine=HeldOutEvalConfig(kwargs={"gravity": 12.0})), None, None, None
        )


def test_a_recurrent_policy_stops_and_resumes_under_the_heldout_engine(example_modules, tmp_path):
    """The heldout engine extends the sync engine's loops rather than copying them, so its checkpoints hold what
    the sync engine's do: a recurrent policy's per-env state too (a copy of the loops had lost it: KeyError
    'recurrent_state' on resume)."""
    import json

    import spmd_rl

    config = {
        "env": {"id": "CartPole-v1", "num_envs": 3},
        "engine": {"class": "heldout_engine:HeldOutEvalEngine", "every": 1, "episodes": 1, "kwargs": {}},
        "algo": {"class": "spmd_rl.algorithms.recurrent_ppo:RecurrentPPO", "num_steps": 16, "num_minibatches": 2},
        "policy": {"recurrent_size": 8, "hidden_sizes": [8]},
        "train": {"total_steps": 16 * 3 * 3},
        "log": {"progress": False, "tensorboard": False},
    }
    overrides = {"run.dir": str(tmp_path / "run"), "run.stop_after_iterations": 1}
    assert not spmd_rl.train(config, overrides).finished
    state = torch.load(tmp_path / "run" / "checkpoints" / "iter_000000000" / "rank0.pt", weights_only=True)
    assert state["inference_server"]["recurrent_state"]["h"].shape == (3, 8), "the checkpoint holds every env's state"
    assert spmd_rl.train(config, overrides).finished
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [0, 1, 2]
    assert all("heldout_return_mean" in r for r in records)


def test_torch_cartpole_steps_as_gymnasiums_cartpole_and_resets_on_the_next_step(example_modules):
    """The example backend's torch CartPole follows gymnasium's equations, and its vector env autoresets as
    gymnasium's do (NEXT_STEP) with the same episode statistics."""
    import numpy as np
    from gymnasium.envs.classic_control.cartpole import CartPoleVectorEnv
    from torch_cartpole import TorchCartPoleVectorEnv

    ours, theirs = TorchCartPoleVectorEnv(3, 500, seed=0), CartPoleVectorEnv(num_envs=3)
    ours.reset(seed=0)
    theirs.reset(seed=0)
    theirs.state = ours.sim.state.numpy().T.astype(np.float64)  # the same start
    rng = np.random.default_rng(0)
    for step in range(200):  # noqa: B007  (the step the episodes ended at is checked below)
        actions = rng.integers(0, 2, size=3)
        obs, reward, terminated, truncated, info = ours.step(actions)
        obs_theirs, _, terminated_theirs, _, _ = theirs.step(actions)
        np.testing.assert_allclose(obs, obs_theirs, atol=1e-4)  # float32 against float64
        assert terminated.tolist() == terminated_theirs.tolist()
        if terminated.any():
            break
    else:
        pytest.fail("no episode ended within 200 random steps")
    assert info["_episode"].tolist() == terminated.tolist() and not truncated.any()
    assert info["episode"]["l"][terminated].tolist() == [step + 1] * int(terminated.sum())
    ended = terminated.copy()
    obs, reward, terminated, truncated, info = ours.step(np.zeros(3, dtype=np.int64))
    assert (reward[ended] == 0).all() and (reward[~ended] == 1).all()  # the ended envs only reset
    assert (np.abs(obs[ended]) <= 0.05).all()  # a new episode's first observation


def test_a_torch_cartpole_run_resumes_exactly_with_its_envs_state(example_modules, tmp_path, monkeypatch):
    """The example backend saves its envs' state (capture_state): a stopped and resumed run is the uninterrupted
    one, line for line (timings aside)."""
    import json

    import spmd_rl

    monkeypatch.chdir(EXAMPLES / "torch_cartpole")
    overrides = ["env.num_envs=4", "algo.num_steps=16", "algo.num_minibatches=2", "train.total_steps=192"]
    config = "torch_cartpole.yaml"

    def lines(run_dir):
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return [
            {k: v for k, v in r.items() if not (k.startswith("time_") or "sps" in k or k.endswith("_s"))}
            for r in records
        ]

    def train(run_dir, *more):
        return spmd_rl.train(config, dict(item.split("=", 1) for item in [*overrides, f"run.dir={run_dir}", *more]))

    assert train(tmp_path / "full").finished
    assert not train(tmp_path / "split", "run.stop_after_iterations=1").finished
    state = torch.load(tmp_path / "split" / "checkpoints" / "iter_000000000" / "rank0.pt", weights_only=True)
    assert state["env_runner"]["env"]["envs"]["state"].shape == (4, 4), "the checkpoint holds the envs' physics"
    assert train(tmp_path / "split").finished
    assert lines(tmp_path / "split") == lines(tmp_path / "full")


# ---------------------------------------------------------------------------------------------------------------
# examples/pixel_catch's frozen encoder: its own script writes the pretrained encoder; its config is split with 2
# trainers

SPLIT_AS_CONFIGURED = []  # frozen_catch.yaml: layout.mode=split, 2 trainers, 1 inference, 2 env ranks
ONE_PROCESS = ["layout.mode=colocated", "layout.trainer=0", "layout.inference=0", "layout.env=0"]


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["one_process", "split5"])
def test_frozen_encoder_example_runs_from_a_copy_and_keeps_the_pretrained_encoder(layout, tmp_path, monkeypatch):
    from safetensors.torch import load_file

    from spmd_rl.api import load_policy

    folder = copy_example("pixel_catch", tmp_path)
    made = subprocess.run(
        [sys.executable, "make_encoder.py", "--steps", "20"], cwd=folder, env=_env(), capture_output=True, text=True
    )
    assert made.returncode == 0 and (folder / "encoder.safetensors").is_file(), made.stdout + made.stderr
    run_dir = tmp_path / "run"
    nproc, layout_overrides = (0, ONE_PROCESS) if layout == "one_process" else (5, SPLIT_AS_CONFIGURED)
    result = run_in(
        folder,
        ["--config", "frozen_catch.yaml", "algo.num_steps=8", "train.total_steps=512", *layout_overrides]
        + [f"run.dir={run_dir}", "log.progress=false", "weights.verify_every=1"],
        nproc=nproc,
    )
    records = assert_run_complete(result, run_dir, iterations=4)  # 16 envs x 8 steps a iteration
    assert records[-1]["env_steps"] == 512 and records[-1]["episodes"] > 0
    monkeypatch.chdir(folder)  # building the policy reads encoder.safetensors (then policy.pt's weights replace it)
    monkeypatch.syspath_prepend(str(folder))
    policy, _ = load_policy(run_dir)
    pretrained = load_file(folder / "encoder.safetensors")
    trained = policy.encoder.state_dict()
    assert trained.keys() == pretrained.keys()
    assert all(torch.equal(trained[name], pretrained[name]) for name in pretrained)  # frozen: exactly as loaded


def test_the_frozen_encoder_gets_no_gradient_nor_optimizer_state_while_the_head_learns(monkeypatch, tmp_path):
    import gymnasium as gym
    import numpy as np
    from tensordict import TensorDict

    from spmd_rl.algorithms.configs import PPOConfig
    from spmd_rl.algorithms.ppo import PPO
    from spmd_rl.api import Context, UserError

    monkeypatch.syspath_prepend(str(EXAMPLES / "pixel_catch"))
    monkeypatch.chdir(tmp_path)
    from frozen_policy import FrozenEncoderConfig, FrozenEncoderPolicy, PixelEncoder
    from make_encoder import random_play_frames
    from safetensors.torch import load_file, save_file

    frames_space, actions = gym.spaces.Box(0, 255, (10, 5, 1), np.uint8), gym.spaces.Discrete(3)
    with pytest.raises(UserError, match=r"policy.encoder_file 'encoder.safetensors' does not exist.*make_encoder"):
        FrozenEncoderPolicy(frames_space, actions, FrozenEncoderConfig())
    torch.manual_seed(0)
    save_file(PixelEncoder(10, 5, 1).state_dict(), "encoder.safetensors")
    pretrained = load_file("encoder.safetensors")
    policy = FrozenEncoderPolicy(frames_space, actions, FrozenEncoderConfig())
    encoder = list(policy.encoder.parameters())
    assert encoder and not any(p.requires_grad for p in encoder)
    with pytest.raises(UserError, match="does not fit"):
        FrozenEncoderPolicy(gym.spaces.Box(0, 255, (12, 5, 1), np.uint8), actions, FrozenEncoderConfig())

    frames = random_play_frames(64, seed=0, rows=10, columns=5)
    with torch.no_grad():
        out = policy.act(frames)
    advantage = torch.randn(64)
    batch = TensorDict(
        obs=frames,
        **out,
        advantage=advantage,
        return_=out["value"] + advantage,
        valid=torch.ones(64, dtype=bool),
        batch_size=[64],
    )
    ppo = PPO(policy, PPOConfig(update_epochs=2, num_minibatches=2), Context.local(frames_space, actions))
    head = [p.detach().clone() for p in policy.actor.parameters()]
    ppo.update(batch, iteration=0)
    assert all(p.grad is None and p not in ppo.optimizer.state for p in encoder)
    assert all(torch.equal(policy.encoder.state_dict()[name], t) for name, t in pretrained.items())
    assert all(p in ppo.optimizer.state for p in policy.actor.parameters())
    assert not all(torch.equal(a, b) for a, b in zip(head, policy.actor.parameters()))
