"""Role pieces that need no other rank: the env runner's rollout bookkeeping and the segment -> transitions view."""

import re

import gymnasium as gym
import pytest
import torch
from tensordict import TensorDict

from spmd_rl.algorithms.sac import transitions_of
from spmd_rl.api import StepField
from spmd_rl.comm.local_channel import local_channel
from spmd_rl.config.sections import EnvSection
from spmd_rl.envs.vector import EnvSpec, make_vector_env, probe_env
from spmd_rl.roles.local_env_runner import local_env_runner
from spmd_rl.roles.messages import segment_message
from spmd_rl.roles.trainer import PolicyLagError, Trainer
from spmd_rl.runtime.errors import CommError

OUTPUTS = {
    "action": StepField((), torch.int64),
    "log_prob": StepField((), torch.float32),
    "value": StepField((), torch.float32),
}


def _segment_with(obs, valid, terminated, next_obs):
    t, n = valid.shape
    spec = EnvSpec("x", gym.spaces.Box(-1, 1, (1,)), gym.spaces.Box(-1, 1, (1,)))
    segment = segment_message(spec, {"action": StepField((1,), torch.float32)}, t, n)
    segment["rollout", "obs"].copy_(obs)
    segment["rollout", "valid"].copy_(valid)
    segment["rollout", "terminated"].copy_(terminated)
    segment["rollout", "reward"].copy_(torch.arange(t * n, dtype=torch.float32).reshape(t, n))
    segment["next_obs"].copy_(next_obs)
    return segment


def test_transitions_skip_reset_steps_and_take_the_final_observation():
    # One env, 4 steps: the episode ends at t=1 (obs[2] is its final obs), t=2 is the reset step.
    obs = torch.tensor([[[0.0]], [[1.0]], [[2.0]], [[10.0]]])
    valid = torch.tensor([[True], [True], [False], [True]])
    terminated = torch.tensor([[False], [True], [False], [False]])
    rows = transitions_of(_segment_with(obs, valid, terminated, next_obs=torch.tensor([[11.0]])))
    assert rows["obs"].flatten().tolist() == [0.0, 1.0, 10.0]
    assert rows["next_obs"].flatten().tolist() == [1.0, 2.0, 11.0]
    assert rows["terminated"].tolist() == [False, True, False]
    assert rows["reward"].tolist() == [0.0, 1.0, 3.0]


def test_env_worker_marks_the_step_after_an_episode_end_invalid():
    cfg = EnvSection(id="CartPole-v1", num_envs=3)
    spec = probe_env(cfg)
    envs, first_obs = make_vector_env(cfg, spec, seed=0)
    steps = 60
    worker, obs_in, actions_out, segments_in = local_env_runner(envs, first_obs, spec, OUTPUTS, steps)
    for t in range(steps):
        worker.send_observations(t)
        obs_in.recv()
        actions_out.buffer["action"].fill_(1)  # always push right: episodes end after ~10 steps
        actions_out.send()
        worker.receive_actions_and_step(t)
    worker.send_segment()
    rollout = segments_in.recv()["rollout"]
    done = rollout["terminated"] | rollout["truncated"]
    assert done.any()
    assert torch.equal(rollout["valid"][1:], ~done[:-1]), "exactly the steps after an episode end are invalid"
    assert rollout["valid"][0].all()
    # Episode statistics are recorded where episodes end, with the episode's length.
    assert torch.equal(rollout["episode_done"], done)
    assert (rollout["episode_length"][done] > 0).all()
    worker.close()


def test_trainer_rejects_a_segment_acted_on_with_stale_weights():
    spec = EnvSpec("x", gym.spaces.Box(-1, 1, (3,)), gym.spaces.Discrete(2))
    segment_out, segment_in = local_channel("segments", segment_message(spec, OUTPUTS, 4, 2))
    segment_out.buffer["policy_version"].fill_(4)
    segment_out.buffer["policy_version"][2] = 3  # one step acted with the previous weights
    segment_out.send()
    trainer = Trainer(
        algorithm=None, segment_channels=[segment_in], segment_sources=["rank 5 (env 1)"], episode_slots=8, group=None
    )
    with pytest.raises(
        PolicyLagError,
        match=r"iteration 7: segments from \['rank 5 \(env 1\)'\] acted with policy "
        r"versions outside \[4, 4\]",
    ):
        trainer.receive_segments(iteration=7, version=4)


class _PeerGoneAlgorithm:
    """learn fails as torch's own collective inside backward() does when a peer trainer was killed (gloo's text)."""

    def learn(self, segment, iteration):
        raise RuntimeError("[gloo/transport/tcp/pair.cc:534] Read error [127.0.0.1]:12202: Connection reset by peer")


@pytest.mark.parametrize(
    "sharded, collective",
    [(False, "DDP's gradient all-reduce"), (True, "FSDP2's parameter all-gather or gradient reduce-scatter")],
)
def test_a_peer_lost_while_learning_names_the_collective_of_the_parallel_mode(sharded, collective):
    trainer = Trainer(
        algorithm=_PeerGoneAlgorithm(),
        segment_channels=[],
        segment_sources=[],
        episode_slots=1,
        group=None,
        describe="rank 0 (colocated 0)",
        sharded=sharded,
    )
    with pytest.raises(CommError, match=re.escape(f"({collective} or the algorithm's own)")):
        trainer.learn(TensorDict({}, batch_size=[]), iteration=10)
