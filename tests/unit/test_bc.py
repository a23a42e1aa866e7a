"""bc (behaviour cloning) on demonstrations a scripted expert made on a real env (harness/demos.py), in process: 20
steps lower the loss for the Gaussian, binned and discrete heads with action chunks (some cut short, zeros past
their ends) and Dict observations (image, state, token ids); what a file holds past a chunk's valid steps changes
neither the loss nor the gradient (actor-critic heads in bc, the vla's heads directly), and a policy whose forward
takes no chunk_valid is refused; each trainer's share is every other episode; bad demonstrations are one UserError
naming the file and the key; the plan of an algorithm without rollouts."""

from __future__ import annotations

import math

import gymnasium as gym
import h5py
import numpy as np
import pytest
import torch
from harness.demos import ReachExpert, ScriptedExpert, collect
from harness.parts import one_torch_thread  # noqa: F401 (an autouse fixture)

from spmd_rl.algorithms.bc import BC
from spmd_rl.algorithms.configs import BCConfig
from spmd_rl.algorithms.demonstrations import demonstration_files, expected_layout, read_share
from spmd_rl.config.loading import load_config
from spmd_rl.envs.vector import probe_env
from spmd_rl.interfaces.context import Context
from spmd_rl.modules.actor_critic import ActorCritic
from spmd_rl.modules.configs import ActorCriticConfig
from spmd_rl.run.plan import plan_run
from spmd_rl.run.topology import build_topology
from spmd_rl.runtime.errors import UserError

REACH = ["env.id=tests.harness.vla_fixtures:InstructedReach-v0", "env.num_envs=4", "env.action_chunk=2"]
INSTRUCTED = ["env.id=tests.harness.instructed_env:Instructed-v0", "env.num_envs=4"]


class InstructedExpert(ScriptedExpert):
    """Instructed-v0's expert: the target its instruction names ("red" is 0, "blue" 1; bytes tokens)."""

    def outputs(self):
        from spmd_rl.interfaces.policy import StepField

        return {"action": StepField((), torch.int64)}

    def actions(self, obs):
        return torch.tensor([0 if b"red" in bytes(row.tolist()) else 1 for row in obs["instruction"]["ids"]])


@pytest.fixture(scope="module")
def reach_demos(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("reach")
    collect(run_dir, [*REACH, "algo.num_steps=10"], ReachExpert, rollouts=2)
    return run_dir


def spaces(overrides):
    spec = probe_env(load_config(None, overrides).env)
    return spec.observation_space, spec.action_space


def make_bc(demos, overrides, policy_changes=(), **changes):
    observation_space, action_space = spaces(overrides)
    torch.manual_seed(0)
    small = dict(hidden_sizes=[32], cnn_channels=[4], cnn_kernels=[3], cnn_strides=[2], cnn_features=16)
    policy = ActorCritic(observation_space, action_space, ActorCriticConfig(**small, **dict(policy_changes)))
    config = BCConfig(demos=str(demos), batch_size=32, learning_rate=1e-2, **changes)
    return BC(policy, config, Context.local(observation_space, action_space))


@pytest.mark.parametrize("head", [(), (("action_bins", 11),)], ids=["gaussian", "binned"])
def test_twenty_steps_lower_the_loss_with_chunks_cut_short_and_dict_observations(reach_demos, tmp_path, head):
    bc = make_bc(cut_copy(reach_demos, tmp_path / "cut.h5", tail=0.0)[0], REACH, head)  # zeros past the ends
    assert bc.decisions["action"].shape[1:] == (2, 2) and bc.decisions["obs", "image"].dtype == torch.uint8
    losses = [bc.learn(None, iteration)["nll_loss"] for iteration in range(20 // bc.steps_per_epoch)]
    assert bc.steps_per_epoch * len(losses) == 20
    assert losses[-1] < losses[0] - 0.5, losses


def test_cross_entropy_of_a_discrete_head_falls(tmp_path):
    collect(tmp_path, [*INSTRUCTED, "algo.num_steps=10"], InstructedExpert, rollouts=1)
    bc = make_bc(tmp_path, INSTRUCTED)
    first = bc.learn(None, 0)["nll_loss"]
    assert math.isclose(first, math.log(2), abs_tol=0.05)  # two actions, an untrained head: about ln 2
    last = [bc.learn(None, i)["nll_loss"] for i in range(1, 20)][-1]
    assert last < 0.3


def test_observation_statistics_come_from_the_demonstrations(reach_demos):
    bc = make_bc(reach_demos, REACH, (("normalize_obs", True),))
    states = bc.decisions["obs", "state"].double()
    normalizer = bc.policy.encoder.encoders["state"].normalizer
    assert torch.allclose(normalizer.mean, states.mean(0), atol=1e-3)  # its prior count is tiny, not zero


def test_each_trainer_reads_every_other_episode(reach_demos):
    files = demonstration_files(str(reach_demos))
    layout = expected_layout(*spaces(REACH))
    whole = read_share(files, layout, 0, 1)
    halves = [read_share(files, layout, index, 2) for index in range(2)]
    assert whole.episodes == halves[0].episodes == halves[1].episodes > 4
    assert len(halves[0].decisions) + len(halves[1].decisions) == len(whole.decisions)
    assert abs(len(halves[0].decisions) - len(halves[1].decisions)) <= 4  # about half each, by whole episodes
    # 4 envs x 20 rows: 4 episodes each of 4 decisions (8 steps in chunks of 2), each followed by its reset step.
    assert (whole.episodes, len(whole.decisions)) == (16, 64)


def cut_copy(reach_demos, path, tail=None, cut=True):
    """A copy of the reach demonstrations whose every third decision ran only its first action (chunk_valid
    [True, False] unless not cut), its second action replaced by tail where given (what a file holds past an
    episode's end: collect's zeros, or anything)."""
    path.write_bytes((reach_demos / "buffer" / "experience_rank0.h5").read_bytes())
    with h5py.File(path, "r+") as file:
        rows = np.flatnonzero(file["data/valid"][:])[::3]
        if cut:
            chunk_valid = file["data/chunk_valid"][:]
            chunk_valid[rows, 1] = False
            file["data/chunk_valid"][:] = chunk_valid
        if tail is not None:
            action = file["data/action"][:]
            action[rows, 1] = tail
            file["data/action"][:] = action
    return path, len(rows)


def test_a_chunk_cut_short_is_counted_and_its_valid_steps_read(reach_demos, tmp_path):
    path, cut = cut_copy(reach_demos, tmp_path / "cut.h5")
    share = read_share([path], expected_layout(*spaces(REACH)), 0, 1)
    assert (share.cut_chunks, len(share.decisions)) == (cut, 64) and cut > 10
    assert share.decisions["chunk_valid"].shape == (64, 2) and int((~share.decisions["chunk_valid"]).sum()) == cut


@pytest.mark.parametrize("head", [(), (("action_bins", 11),)], ids=["gaussian", "binned"])
def test_what_a_file_holds_past_a_chunks_valid_steps_changes_neither_loss_nor_gradient(reach_demos, tmp_path, head):
    def learned(path):
        bc = make_bc(path, REACH, head)
        metrics = [bc.learn(None, iteration) for iteration in range(3)]  # Adam steps: the gradients, compared
        return [m["nll_loss"] for m in metrics], bc.policy.state_dict()

    zeros, _ = cut_copy(reach_demos, tmp_path / "zeros.h5", tail=0.0)
    losses, weights = learned(zeros)
    other_losses, other_weights = learned(cut_copy(reach_demos, tmp_path / "other.h5", tail=0.9)[0])
    assert losses == other_losses and all(torch.equal(weights[key], other_weights[key]) for key in weights)
    # Not vacuous: learned whole (chunk_valid all true), the same tails do change both.
    whole_losses, whole_weights = learned(cut_copy(reach_demos, tmp_path / "whole.h5", tail=0.9, cut=False)[0])
    assert whole_losses != losses and not all(torch.equal(weights[key], whole_weights[key]) for key in weights)


class ChunkBlindPolicy(ActorCritic):
    """A policy whose forward takes no chunk_valid (a policy.class of someone's own)."""

    def forward(self, obs, action):
        return self.evaluate(obs, action)


def test_a_policy_whose_forward_takes_no_chunk_valid_is_refused_on_chunked_demonstrations(reach_demos):
    observation_space, action_space = spaces(REACH)
    policy = ChunkBlindPolicy(observation_space, action_space, ActorCriticConfig(hidden_sizes=[8]))
    with pytest.raises(UserError, match=r"ChunkBlindPolicy's forward takes no chunk_valid: define forward\(self, obs"):
        BC(policy, BCConfig(demos=str(reach_demos)), Context.local(observation_space, action_space))


@pytest.mark.parametrize("head", ["gaussian", "bins"])
def test_the_vla_heads_sum_a_chunks_valid_steps_only(head):
    from harness.vla_fixtures import InstructedReach

    from spmd_rl.envs.spaces import zeros_of
    from spmd_rl.modules.configs import VLAConfig
    from spmd_rl.modules.vla import VLAPolicy

    observation_space = InstructedReach().observation_space
    torch.manual_seed(0)
    policy = VLAPolicy(observation_space, gym.spaces.Box(-1.0, 1.0, (3, 2)), VLAConfig(action_head=head))
    obs, action = zeros_of(observation_space, 3), torch.rand(3, 3, 2) * 2 - 1
    chunk_valid = torch.tensor([[True, True, True], [True, False, False], [True, True, False]])
    log_prob = policy(obs, action, chunk_valid=chunk_valid)[0]
    assert torch.equal(log_prob, policy(obs, torch.where(chunk_valid[..., None], action, 0.0), chunk_valid)[0])
    whole = policy(obs, action)[0]
    assert torch.allclose(whole, policy(obs, action, torch.ones(3, 3, dtype=torch.bool))[0])
    assert torch.allclose(log_prob[0], whole[0]) and not torch.allclose(log_prob[1:], whole[1:])


def test_demonstrations_of_another_layout_name_the_file_and_the_key(reach_demos):
    other = spaces(INSTRUCTED)
    with pytest.raises(UserError, match=r"experience_rank0\.h5: key 'action' is float32\[2, 2\].*int64\[\]"):
        BC.check_spaces(BCConfig(demos=str(reach_demos)), *other)
    image_only = spaces([*REACH, "env.kwargs={image_size: 8}"])
    with pytest.raises(UserError, match=r"experience_rank0\.h5: key 'obs/image' is uint8\[20, 20, 3\], and this env's"):
        BC.check_spaces(BCConfig(demos=str(reach_demos)), *image_only)
    BC.check_spaces(BCConfig(demos=str(reach_demos / "buffer" / "*.h5")), *spaces(REACH))  # a glob


def test_missing_demonstrations_are_refused(tmp_path):
    with pytest.raises(UserError, match=r"algo.demos=.*nowhere: no such file or folder"):
        demonstration_files(str(tmp_path / "nowhere"))
    with pytest.raises(UserError, match="algo.demos is not set"):
        demonstration_files("")
    with pytest.raises(UserError, match="holds no .h5 files"):
        demonstration_files(str(tmp_path))


def test_a_plan_without_rollouts_takes_its_iterations_from_the_algorithm(reach_demos):
    cfg = load_config(None, [*REACH, "algo.class=bc", f"algo.demos={reach_demos}", "algo.iterations=7"])
    plan = plan_run(cfg, build_topology(cfg.layout, 1), BC)
    assert (plan.num_steps, plan.steps_per_iteration, plan.num_iterations, plan.explore_iterations) == (0, 0, 7, 0)
    cfg = load_config(None, [*REACH, "algo.class=bc", f"algo.demos={reach_demos}", "algo.batch_size=33"])
    with pytest.raises(UserError, match="algo.batch_size=33 cannot be shared equally by 2 trainers"):
        plan_run(cfg, build_topology(cfg.layout, 2), BC)
    split = ["layout.mode=split", "layout.trainer=1", "layout.inference=1", "layout.env=1", "engine.class=async"]
    cfg = load_config(None, [*REACH, "algo.class=bc", f"algo.demos={reach_demos}", *split])
    with pytest.raises(UserError, match="algo.class 'bc' rolls out nothing; use engine.class=sync"):
        plan_run(cfg, build_topology(cfg.layout, 3), BC)
