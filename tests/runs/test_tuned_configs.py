"""The RL-Zoo-tuned MuJoCo configs (configs/mujoco/) each train one iteration and evaluate once, in this process,
with their own keys (totals and the SAC and TD3 warm-ups shortened so the test stays fast); and the knobs they brought:
policy.ortho_init=false keeps torch's nn.Linear initialization, env.normalize_reward_gamma and env.clip_reward reach
the reward wrappers."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch
from harness.launch import ROOT

import spmd_rl
from spmd_rl.config.loading import load_config
from spmd_rl.envs.backend import finish_vector_env
from spmd_rl.modules.actor_critic import ActorCritic

pytest.importorskip("mujoco", reason="the tuned MuJoCo configs need the mujoco extra")

CONFIGS = ROOT / "configs" / "mujoco"
PPO = sorted(CONFIGS.glob("ppo_*.yaml"))
SAC = sorted(CONFIGS.glob("sac_*.yaml"))
TD3 = sorted(CONFIGS.glob("td3_*.yaml"))


def test_there_is_a_ppo_and_a_sac_config_per_task():
    tasks = {"halfcheetah", "hopper", "walker2d"}
    assert {p.stem.removeprefix("ppo_") for p in PPO} == tasks
    assert {p.stem.removeprefix("sac_") for p in SAC} == tasks


@pytest.mark.parametrize("config", PPO + SAC + TD3, ids=lambda p: p.stem)
def test_a_tuned_config_trains_an_iteration_and_evaluates(config, tmp_path):
    cfg = load_config(str(config), [])
    steps = cfg.algo.num_steps * cfg.env.num_envs
    overrides = {"run.dir": tmp_path / "run", "eval.every": 1, "eval.episodes": 1, "log.progress": False}
    if cfg.classes["algo"] in ("sac", "td3"):
        # a few iterations past a short warm-up, so that gradient steps run too
        overrides.update({"train.total_steps": 40 * steps, "algo.learning_starts": 20, "buffer.capacity": 1000})
        overrides["eval.every"] = 40
    else:
        overrides["train.total_steps"] = steps
    run = spmd_rl.train(config, overrides)
    assert run.finished
    assert run.metrics["env_steps"] == overrides["train.total_steps"]
    assert np.isfinite(run.metrics["eval_return_mean"])


def test_ortho_init_false_keeps_torchs_linear_initialization():
    obs = gym.spaces.Box(-1, 1, (3,))
    act = gym.spaces.Box(-1, 1, (2,))
    cfg = load_config(None, []).policy
    torch.manual_seed(0)
    orthogonal = ActorCritic(obs, act, cfg).actor
    torch.manual_seed(0)
    default = ActorCritic(obs, act, type(cfg)(**{**vars(cfg), "ortho_init": False})).actor
    torch.manual_seed(0)
    reference = torch.nn.Linear(3, cfg.hidden_sizes[0])  # the first layer draws first, as nn.Linear draws it
    assert torch.equal(default[0].weight, reference.weight) and torch.equal(default[0].bias, reference.bias)
    assert torch.count_nonzero(orthogonal[0].bias) == 0 and torch.count_nonzero(default[0].bias) > 0


def test_reward_normalization_discounts_with_its_gamma_and_clips():
    overrides = ["env.normalize_reward=true", "env.normalize_reward_gamma=0.5", "env.clip_reward=0.3"]
    env_cfg = load_config(None, overrides).env
    envs = gym.make_vec("CartPole-v1", num_envs=2, vectorization_mode="sync")
    envs, _ = finish_vector_env(envs, env_cfg, seed=0, reset_seed=0)
    rewards = np.concatenate([envs.step(np.array([0, 1]))[1] for _ in range(30)])
    assert np.abs(rewards).max() <= 0.3 + 1e-6 and np.isclose(np.abs(rewards).max(), 0.3)
    layers = [envs]
    while hasattr(layers[-1], "env"):
        layers.append(layers[-1].env)
    normalizer = next(layer for layer in layers if isinstance(layer, gym.wrappers.vector.NormalizeReward))
    assert normalizer.gamma == 0.5
