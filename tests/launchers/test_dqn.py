"""Built-in DQN (`algo.class: dqn`, `policy.class: q_network`): n-step transitions of a segment, the Double DQN
target, the epsilon schedule and epsilon-greedy acting; end to end in one process, colocated 2 and split 4, each
N iterations equal to N/2, a stop and a resume (line for line, weights byte for byte)."""

from __future__ import annotations

import subprocess

import gymnasium as gym
import pytest
import torch
from harness import runs
from harness.launch import ROOT, job_env, with_pythonpath
from tensordict import TensorDict

from spmd_rl.algorithms.configs import DQNConfig
from spmd_rl.algorithms.dqn import DQN, n_step_transitions
from spmd_rl.api import Context
from spmd_rl.modules.configs import QNetworkConfig
from spmd_rl.modules.q_network import QNetwork
from spmd_rl.runtime.errors import UserError

OBS = gym.spaces.Box(-1.0, 1.0, (3,))
ACTIONS = gym.spaces.Discrete(4)


def segment(rewards, terminated, truncated, valid) -> TensorDict:
    """One env's segment [T, 1] whose observation at step t is [t, t, t] (the segment's next_obs: T)."""
    steps = len(rewards)
    column = lambda values, dtype: torch.tensor(values, dtype=dtype).unsqueeze(-1)  # noqa: E731
    obs = torch.arange(steps, dtype=torch.float32).reshape(steps, 1, 1).expand(steps, 1, 3).clone()
    rollout = TensorDict(
        {
            "obs": obs,
            "action": torch.zeros(steps, 1, dtype=torch.int64),
            "reward": column(rewards, torch.float32),
            "terminated": column(terminated, torch.bool),
            "truncated": column(truncated, torch.bool),
            "valid": column(valid, torch.bool),
        },
        batch_size=[steps, 1],
    )
    return TensorDict({"rollout": rollout, "next_obs": torch.full((1, 3), float(steps))}, batch_size=[])


def test_n_step_returns_stop_at_termination_truncation_and_the_segment_end():
    # steps:        0    1    2     3      4    5    6
    rewards = [1.0, 2.0, 4.0, 0.0, 1.0, 1.0, 1.0]
    terminated = [0, 0, 1, 0, 0, 0, 0]  # step 2 terminates; step 3 is the reset step (invalid)
    truncated = [0, 0, 0, 0, 1, 0, 0]  # step 4 is truncated: bootstrap from its final observation
    valid = [1, 1, 1, 0, 1, 1, 1]
    rows = n_step_transitions(segment(rewards, terminated, truncated, valid), gamma=0.5, n=3)
    # rows: steps 0, 1, 2, 4, 5, 6
    assert rows["reward"].tolist() == [1 + 1 + 1, 2 + 2, 4, 1, 1 + 0.5, 1]
    assert rows["discount"].tolist() == [0.0, 0.0, 0.0, 0.5, 0.25, 0.5]
    # bootstrap observations: after step 2 (terminated, unused), 2, 2, after 4 (its final obs, obs[5]), end, end
    assert rows["next_obs"][:, 0].tolist() == [3.0, 3.0, 3.0, 5.0, 7.0, 7.0]

    one = n_step_transitions(segment(rewards, terminated, truncated, valid), gamma=0.5, n=1)
    assert one["reward"].tolist() == [1, 2, 4, 1, 1, 1]
    assert one["discount"].tolist() == [0.5, 0.5, 0.0, 0.5, 0.5, 0.5]
    assert one["next_obs"][:, 0].tolist() == [1, 2, 3, 5, 6, 7]


def make_dqn(**changes) -> DQN:
    torch.manual_seed(0)
    policy = QNetwork(OBS, ACTIONS, QNetworkConfig(hidden_sizes=[16]))
    context = Context.local(OBS, ACTIONS, num_iterations=10, steps_per_iteration=100)
    return DQN(policy, DQNConfig(**changes), context)


def test_double_dqn_values_the_online_argmax_with_the_target_network():
    dqn = make_dqn(double=True)
    with torch.no_grad():
        for param in dqn.target.parameters():
            param.add_(torch.randn_like(param))
    next_obs = torch.randn(5, 3)
    online, target = dqn.q_network.q_values(next_obs), dqn.target.q_values(next_obs)
    reward, discount = torch.ones(5), torch.tensor([0.9, 0.9, 0.0, 0.9, 0.9])
    double = dqn.td_target(reward, next_obs, discount)
    expected = target.gather(-1, online.argmax(-1, keepdim=True)).squeeze(-1)
    assert torch.allclose(double, 1 + torch.where(discount > 0, 0.9 * expected, 0.0))
    dqn.cfg.double = False
    assert torch.allclose(dqn.td_target(reward, next_obs, discount), 1 + discount * target.max(-1).values)


def test_epsilon_falls_linearly_then_stays_and_acting_follows_it():
    dqn = make_dqn(exploration_fraction=0.5, exploration_initial_eps=1.0, exploration_final_eps=0.1)
    assert (
        dqn.epsilon_at(0) == 1.0
        and dqn.epsilon_at(250) == pytest.approx(0.55)
        and dqn.epsilon_at(900) == pytest.approx(0.1)
    )
    policy = dqn.q_network
    obs = torch.randn(1, 3).expand(4000, 3)
    greedy = policy.act(obs, deterministic=True)["action"]
    assert (greedy == greedy[0]).all()
    policy.epsilon.fill_(0.0)
    assert torch.equal(policy.act(obs)["action"], greedy)
    policy.epsilon.fill_(1.0)  # uniform: each action about a quarter of the time
    counts = torch.bincount(policy.act(obs)["action"], minlength=4)
    assert (counts > 800).all()


def test_updates_on_a_fixed_batch_lower_the_loss_and_a_hard_target_update_copies():
    dqn = make_dqn(learning_rate=1e-2)
    batch = TensorDict(
        {
            "obs": torch.randn(32, 3),
            "action": torch.randint(4, (32,)),
            "reward": torch.randn(32),
            "next_obs": torch.randn(32, 3),
            "discount": torch.zeros(32),
        },
        batch_size=[32],
    )
    first = dqn.update(batch)["loss"]
    for _ in range(200):
        last = dqn.update(batch)["loss"]
    assert last < first / 2
    dqn.update_target()
    assert all(torch.equal(a, b) for a, b in zip(dqn.target.parameters(), dqn.q_network.parameters()))


def test_continuous_actions_are_a_user_error():
    with pytest.raises(UserError, match="DQN needs discrete actions"):
        QNetwork(OBS, gym.spaces.Box(-1, 1, (2,)), QNetworkConfig())


# ---------------------------------------------------------------------------------------------------------------
# End to end: N = N/2 + N/2 in every layout

DQN_TINY = [
    "--config",
    str(ROOT / "configs" / "dqn_cartpole.yaml"),
    "env.num_envs=2",
    "algo.num_steps=8",
    "train.total_steps=320",
    "algo.learning_starts=64",
    "algo.batch_size=16",
    "algo.n_step=3",
    "algo.target_update_interval=40",
    "policy.hidden_sizes=[16,16]",
    "eval.every=0",
    "log.progress=false",
    "log.tensorboard=false",
]


def run_main(*args, nproc: int = 0, timeout: float = 240) -> subprocess.CompletedProcess:
    return runs.run_main(*args, nproc=nproc, timeout=timeout, env=with_pythonpath(job_env(), ROOT))


CASES = {
    "one-process": ([], 0, 10),
    "colocated-2": ([], 2, 5),  # 2 envs per rank: 32 steps an iteration, 10 iterations
    "split-4-hdf5": ([*runs.SPLIT4, "buffer.backend=hdf5"], 4, 5),  # 2 env ranks of 2 envs: 10 iterations
    "colocated-2-fsdp": (["train.parallel=fsdp"], 2, 5),  # sharded online and target networks, sharded checkpoints
}


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_n_iterations_equal_half_then_resume(tmp_path, case):
    extra, nproc, half = CASES[case]
    args = [*DQN_TINY, *extra]
    launch = {"nproc": nproc, "env": with_pythonpath(job_env(), ROOT)}
    last = runs.assert_halves_equal_whole(args, tmp_path, half, **launch)[-1]
    assert last["loss"] > 0 and last["epsilon"] < 1.0  # it learned and its epsilon fell
