"""Checkpoints written before components had names (every component's keys side by side at the top level of a
rank file) resume exactly and are read by evaluation, as checkpoints in the layout of named components are."""

from __future__ import annotations

import torch
from harness.parts import RECURRENT_TINY
from harness.runs import assert_same_run

import spmd_rl
from spmd_rl.persist.checkpoint import CheckpointStore
from spmd_rl.persist.rank_state import ENV_RUNNER, INFERENCE_SERVER, REPORT, TRAINER


def as_flat_layout(state: dict) -> dict:
    """A rank state as the earlier versions wrote it: the trainer's keys, "metrics" (the report's), the env
    runner's "env" and "worker", the inference server's "recurrent_state", the iteration and the generators."""
    named = (TRAINER, REPORT, ENV_RUNNER, INFERENCE_SERVER)
    flat = {**state[TRAINER], "metrics": state[REPORT], **state[ENV_RUNNER], **state.get(INFERENCE_SERVER, {})}
    return {**flat, **{key: value for key, value in state.items() if key not in named}}


def test_a_checkpoint_in_the_flat_layout_resumes_exactly_and_its_policy_loads(tmp_path):
    config = RECURRENT_TINY  # 4 iterations, and a recurrent state in every checkpoint
    assert spmd_rl.train(config, {"run.dir": str(tmp_path / "full")}).finished
    parts = {"run.dir": str(tmp_path / "parts"), "run.stop_after_iterations": 2}
    assert not spmd_rl.train(config, parts).finished
    checkpoint = tmp_path / "parts" / "checkpoints" / "iter_000000001"
    state = torch.load(checkpoint / "rank0.pt", weights_only=True)
    assert "recurrent_state" in state[INFERENCE_SERVER]
    store = CheckpointStore(tmp_path / "parts")
    store.save(as_flat_layout(state), iteration=1, rank=0)  # rewritten as an earlier version wrote it
    store.commit(1, world_size=1)
    assert "policy" in torch.load(checkpoint / "rank0.pt", weights_only=True)
    policy, _ = spmd_rl.load_policy(checkpoint)
    assert all(torch.equal(value, state[TRAINER]["policy"][key]) for key, value in policy.state_dict().items())
    assert spmd_rl.train(config, parts).finished
    assert_same_run(tmp_path / "full", tmp_path / "parts")
