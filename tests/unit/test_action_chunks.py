"""Action chunks (env.action_chunk): a decision's K actions run as primitive steps that stop at an episode's end,
the segment's K rewards and validity mask, primitive-step counts, and discounting within a chunk."""

import gymnasium as gym
import numpy as np
import pytest
import torch

from spmd_rl.algorithms.ppo import PPO, chunk_discounts, compute_gae
from spmd_rl.algorithms.sac import SAC
from spmd_rl.api import StepField
from spmd_rl.config.loading import load_config
from spmd_rl.config.sections import EnvSection
from spmd_rl.envs.vector import make_vector_env, probe_env
from spmd_rl.modules.actor_critic import ActorCritic
from spmd_rl.modules.configs import ActorCriticConfig
from spmd_rl.roles.local_env_runner import local_env_runner
from spmd_rl.run.evaluation import evaluate
from spmd_rl.run.plan import plan_run
from spmd_rl.run.topology import build_topology
from spmd_rl.runtime.errors import UserError


class Countdown(gym.Env):
    """An episode of `length` steps whose reward is the action taken: a chunk's recorded rewards show which of its
    actions ran, in which order. The observation counts the steps taken."""

    observation_space = gym.spaces.Box(0, 100, (1,), np.float32)
    action_space = gym.spaces.Box(-1000, 1000, (1,), np.float32)

    def __init__(self, length: int = 6):
        self.length = length
        self.steps = 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.steps = 0
        return np.zeros(1, np.float32), {}

    def step(self, action):
        self.steps += 1
        return np.full(1, self.steps, np.float32), float(action[0]), self.steps == self.length, False, {}


gym.register("ChunkCountdown-v0", entry_point=Countdown)


class SucceedsAtStepTwo(Countdown):
    """Countdown that reports success at its second step only: in the middle of a decision's chunk."""

    def step(self, action):
        obs, reward, terminated, truncated, _ = super().step(action)
        return obs, reward, terminated, truncated, {"success": self.steps == 2}


gym.register("ChunkMidSuccess-v0", entry_point=SucceedsAtStepTwo)

K = 4


def _run_decisions(decisions: int, num_envs: int = 2, env_id: str = "ChunkCountdown-v0"):
    """Steps Countdown envs (episodes of 6 steps) through the env runner with chunks of K; decision d's action k is
    100 d + 10 k + env index."""
    cfg = EnvSection(id=env_id, num_envs=num_envs, action_chunk=K)
    spec = probe_env(cfg)
    outputs = {"action": StepField((K, 1), torch.float32)}
    envs, first_obs = make_vector_env(cfg, spec, seed=0)
    runner, obs_in, actions_out, segments_in = local_env_runner(
        envs, first_obs, spec, outputs, decisions, success_key=spec.success_key
    )
    for d in range(decisions):
        runner.send_observations(d)
        obs_in.recv()
        chunk = 100.0 * d + 10.0 * torch.arange(K)
        actions_out.buffer["action"].copy_((chunk[None, :] + torch.arange(num_envs)[:, None]).unsqueeze(-1))
        actions_out.send()
        runner.receive_actions_and_step(d)
    runner.send_segment()
    segment = segments_in.recv()
    runner.close()
    return spec, segment


def test_a_chunk_stops_at_the_episode_end_and_the_next_decision_resets_without_running_its_chunk():
    spec, segment = _run_decisions(5)
    assert spec.action_space.shape == (K, 1) and spec.action_chunk == K
    rollout = segment["rollout"]
    env0 = rollout[:, 0]
    # Decision 0 runs steps 1-4, decision 1 steps 5-6 (the episode ends at 6), decision 2 is the reset step (no
    # action of its chunk runs), decisions 3 and 4 run the next episode's steps 1-4 and 5-6.
    assert env0["chunk_valid"].tolist() == [
        [True, True, True, True],
        [True, True, False, False],
        [False, False, False, False],
        [True, True, True, True],
        [True, True, False, False],
    ]
    assert env0["reward"].tolist() == [
        [0.0, 10.0, 20.0, 30.0],
        [100.0, 110.0, 0.0, 0.0],
        [0.0, 0.0, 0.0, 0.0],
        [300.0, 310.0, 320.0, 330.0],
        [400.0, 410.0, 0.0, 0.0],
    ]
    assert env0["terminated"].tolist() == [False, True, False, False, True]
    assert env0["valid"].tolist() == [True, True, False, True, True]
    # The episode statistics count primitive steps: 6, not the 2 decisions; the return is every step's reward.
    assert env0["episode_done"].tolist() == [False, True, False, False, True]
    assert env0["episode_length"][env0["episode_done"]].tolist() == [6, 6]
    assert env0["episode_return"][env0["episode_done"]].tolist() == [270.0, 2070.0]
    # Each env executed its own chunk (env 1's actions are env 0's + 1).
    assert torch.equal(rollout[:, 1]["reward"], torch.where(env0["chunk_valid"], env0["reward"] + 1, 0.0))
    assert torch.equal(segment["next_obs"], torch.full((2, 1), 6.0))


def test_a_success_in_the_middle_of_a_chunk_counts_as_success_at_any_step_but_not_at_the_end():
    spec, segment = _run_decisions(5, env_id="ChunkMidSuccess-v0")
    assert spec.success_key == "success"
    env0 = segment["rollout"][:, 0]
    # Steps 1-4 run in decision 0 (success at step 2, not at 4, the chunk's last); the episode ends at decision 1.
    assert env0["episode_success"].tolist() == [False, True, False, False, True]
    assert not env0["episode_success_at_end"].any()


def test_the_experience_log_counts_primitive_steps_under_chunks(tmp_path):
    from tensordict import TensorDict

    from spmd_rl.storage.experience_log import ExperienceLog
    from spmd_rl.storage.reader import HDF5Reader

    rollout = TensorDict({"reward": torch.zeros(3, 2, K)}, batch_size=[3, 2])
    log = ExperienceLog(tmp_path, 0, rollout[0, 0])
    log.append(rollout, policy_version=0, env_step=1 * 3 * 2 * K, steps_per_row=K)  # the second iteration
    log.close()
    with HDF5Reader(tmp_path / "buffer" / "experience_rank0.h5") as reader:
        assert reader.read(meta=True)["meta/env_step"].tolist() == [24 + K * row for row in range(6)]


def test_a_chunk_reward_is_discounted_within_the_chunk_and_the_next_decision_by_the_steps_that_ran():
    gamma = 0.5
    rewards = torch.tensor([[[1.0, 2.0, 4.0]], [[8.0, 16.0, 99.0]]])  # [T=2, N=1, K=3]; 99 never ran
    chunk_valid = torch.tensor([[[True, True, True]], [[True, True, False]]])
    reward, discount = chunk_discounts(rewards, chunk_valid, gamma)
    assert reward.tolist() == [[1 + 0.5 * 2 + 0.25 * 4], [8 + 0.5 * 16]]  # 3 and 16
    assert discount.tolist() == [[0.125], [0.25]]
    values, next_value = torch.tensor([[1.0], [2.0]]), torch.tensor([100.0])
    terminated, truncated = torch.tensor([[False], [True]]), torch.zeros(2, 1, dtype=torch.bool)
    # lambda 1: the return is the discounted sum of the primitive rewards, 1 + .5*2 + .25*4 + .125*8 + .0625*16 = 5.
    advantage, return_ = compute_gae(reward, values, next_value, terminated, truncated, discount, 1.0)
    assert return_.tolist() == [[5.0], [16.0]]
    assert advantage.tolist() == [[4.0], [14.0]]
    # lambda 0.5: delta_0 = 3 + 0.125 * V_1 - V_0 = 2.25; A_0 = 2.25 + 0.125 * 0.5 * A_1 = 2.25 + 0.875.
    advantage, _ = compute_gae(reward, values, next_value, terminated, truncated, discount, 0.5)
    assert advantage.tolist() == [[3.125], [14.0]]


def test_the_actor_critic_acts_in_chunks_and_a_chunks_log_prob_is_its_actions_summed():
    space = gym.spaces.Box(-1, 1, (K, 3), np.float32)
    policy = ActorCritic(gym.spaces.Box(-1, 1, (5,), np.float32), space, ActorCriticConfig(hidden_sizes=[8]))
    assert policy.outputs()["action"] == StepField((K, 3), torch.float32)
    obs = torch.randn(6, 5)
    with torch.no_grad():
        out = policy.act(obs)
        log_prob, _, _ = policy.evaluate(obs, out["action"])
        mean = policy.act(obs, deterministic=True)["action"]
    assert out["action"].shape == (6, K, 3)
    torch.testing.assert_close(log_prob, out["log_prob"])
    per_action = torch.distributions.Normal(mean, policy.log_std.exp().view(K, 3)).log_prob(out["action"])
    torch.testing.assert_close(log_prob, per_action.sum((1, 2)))


def test_the_plan_counts_primitive_steps_and_refuses_chunks_where_they_cannot_run():
    cfg = load_config(None, ["env.id=Pendulum-v1", "env.action_chunk=4", "algo.num_steps=16"])
    plan = plan_run(cfg, build_topology(cfg.layout, 1), PPO)
    assert plan.steps_per_iteration == 16 * 8 * 4 and plan.decisions_per_iteration == 16 * 8
    assert plan.facts().samples_per_trainer == 16 * 8
    assert "(16 steps x 8 envs x 4 actions per chunk)" in plan.describe(cfg, 1, "colocated", PPO)
    sac = load_config(None, ["env.id=Pendulum-v1", "env.action_chunk=4", "algo.class=sac"])
    with pytest.raises(UserError, match="env.action_chunk=4: algo.class 'sac' learns from single actions"):
        plan_run(sac, build_topology(sac.layout, 1), SAC)
    with pytest.raises(UserError, match="env.action_chunk=2 needs a Box action space"):
        probe_env(EnvSection(id="CartPole-v1", action_chunk=2))
    with pytest.raises(UserError, match="env.action_chunk=2 with env.normalize_reward"):
        probe_env(EnvSection(id="Pendulum-v1", action_chunk=2, normalize_reward=True))


def test_evaluation_counts_an_episodes_primitive_steps():
    cfg = EnvSection(id="ChunkCountdown-v0", num_envs=2, action_chunk=K)
    spec = probe_env(cfg)
    policy = ActorCritic(spec.observation_space, spec.action_space, ActorCriticConfig(hidden_sizes=[8]))
    result = evaluate(policy, cfg, episodes=4, seed=0, deterministic=True, max_steps=100)
    assert result["lengths"] == [6, 6, 6, 6]  # 2 decisions each: 4 steps, then 2 before the episode's end


def test_binned_actions_are_on_the_grid_and_a_chunks_log_prob_sums_its_elements_categoricals():
    space = gym.spaces.Box(np.array([-2.0, 0.0], np.float32), np.array([2.0, 1.0], np.float32))
    chunk = gym.spaces.Box(np.broadcast_to(space.low, (K, 2)), np.broadcast_to(space.high, (K, 2)))
    config = ActorCriticConfig(hidden_sizes=[8], action_bins=5)
    policy = ActorCritic(gym.spaces.Box(-1, 1, (3,), np.float32), chunk, config)
    obs = torch.randn(7, 3)
    with torch.no_grad():
        out = policy.act(obs)
        log_prob, entropy, _ = policy.evaluate(obs, out["action"])
    assert out["action"].shape == (7, K, 2)
    grid = torch.tensor([[-2.0, -1.0, 0.0, 1.0, 2.0], [0.0, 0.25, 0.5, 0.75, 1.0]])
    for d in range(2):
        assert torch.isin(out["action"][..., d], grid[d]).all()
    torch.testing.assert_close(log_prob, out["log_prob"])
    assert (entropy <= K * 2 * np.log(5) + 1e-5).all()
    with pytest.raises(UserError, match="policy.action_bins=5 needs finite action bounds"):
        ActorCritic(gym.spaces.Box(-1, 1, (3,)), gym.spaces.Box(-np.inf, np.inf, (2,)), config)
