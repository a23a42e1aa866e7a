"""Action masks (an `action_mask` key of a Dict observation, modules/masks.py): PPO's actor-critic masks its logits,
DQN's Q-network its argmax and its random actions. On an env where a disallowed action ends the episode, random
play fails within a few steps, while both algorithms, trained in this process, never take a disallowed action."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch
from tensordict import TensorDict

import spmd_rl
from spmd_rl.config.loading import load_config
from spmd_rl.modules.actor_critic import ActorCritic
from spmd_rl.modules.configs import QNetworkConfig
from spmd_rl.modules.q_network import QNetwork

ACTIONS = 5
HORIZON = 40


class MaskedChoice(gym.Env):
    """Each step one to three of 5 actions are allowed (a fresh random set); an allowed action pays 1, a
    disallowed one pays 0 and ends the episode; the episode is truncated after 40 steps. With the mask the return
    is 40 whatever the policy; without it a uniform policy's expected return is below 2."""

    def __init__(self):
        self.observation_space = gym.spaces.Dict(
            {"obs": gym.spaces.Box(-1.0, 1.0, (2,)), "action_mask": gym.spaces.MultiBinary(ACTIONS)}
        )
        self.action_space = gym.spaces.Discrete(ACTIONS)

    def _observe(self):
        self.mask = np.zeros(ACTIONS, dtype=np.int8)
        self.mask[self.np_random.choice(ACTIONS, size=self.np_random.integers(1, 4), replace=False)] = 1
        return {"obs": self.np_random.uniform(-1, 1, 2).astype(np.float32), "action_mask": self.mask.copy()}

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.steps = 0
        return self._observe(), {}

    def step(self, action):
        self.steps += 1
        allowed = bool(self.mask[int(action)])
        return self._observe(), float(allowed), not allowed, self.steps >= HORIZON, {}


gym.register("MaskedChoice-v0", entry_point=MaskedChoice)


def test_random_play_without_the_mask_fails():
    env = gym.make("MaskedChoice-v0")
    env.reset(seed=0)
    returns = []
    for _ in range(200):
        env.reset()
        total, done = 0.0, False
        while not done:
            _, reward, terminated, truncated, _ = env.step(env.action_space.sample())
            total, done = total + reward, terminated or truncated
        returns.append(total)
    assert np.mean(returns) < 2.0


def masks_and_obs(batch: int = 256) -> TensorDict:
    mask = torch.rand(batch, ACTIONS) < 0.4
    mask[torch.arange(batch), torch.randint(ACTIONS, (batch,))] = True  # at least one allowed action per row
    return TensorDict({"obs": torch.randn(batch, 2), "action_mask": mask.to(torch.int8)}, batch_size=[batch])


def test_masked_policies_pick_only_allowed_actions_and_give_the_rest_probability_zero():
    torch.manual_seed(0)
    space = MaskedChoice().observation_space
    obs = masks_and_obs()
    allowed = obs["action_mask"].bool()
    policy = ActorCritic(space, gym.spaces.Discrete(ACTIONS), load_config(None, []).policy)
    for deterministic in (False, True):
        action = policy.act(obs, deterministic)["action"]
        assert allowed[torch.arange(256), action].all()
    log_prob, entropy, _ = policy.evaluate(obs, torch.where(allowed, 1, 0).argmax(-1))
    assert torch.isfinite(log_prob).all() and torch.isfinite(entropy).all()
    assert (entropy <= torch.log(allowed.sum(-1).float()) + 1e-5).all()  # the entropy of the allowed actions only

    q_network = QNetwork(space, gym.spaces.Discrete(ACTIONS), QNetworkConfig(hidden_sizes=[16]))
    for epsilon in (0.0, 1.0):
        q_network.epsilon.fill_(epsilon)
        assert allowed[torch.arange(256), q_network.act(obs)["action"]].all()
    assert allowed[torch.arange(256), q_network.act(obs, deterministic=True)["action"]].all()


@pytest.mark.parametrize("algo", ["ppo", "dqn"])
def test_training_with_the_mask_never_takes_a_disallowed_action(algo, tmp_path):
    overrides = {
        "env.id": "MaskedChoice-v0",
        "env.num_envs": 2,
        "env.vectorization": "sync",
        "train.total_steps": 320,
        "run.dir": tmp_path / "run",
        "log.progress": False,
        "eval.every": 2,
        "eval.episodes": 2,
    }
    if algo == "dqn":
        # no random warm-up: it draws from the action space, which knows no mask
        overrides.update({"algo.class": "dqn", "algo.learning_starts": 0, "algo.num_steps": 16})
    else:
        overrides.update({"algo.num_steps": 40, "algo.update_epochs": 2})
    run = spmd_rl.train(None, overrides)
    assert run.finished
    assert run.metrics["episode_return_mean"] == HORIZON and run.metrics["eval_return_mean"] == HORIZON
