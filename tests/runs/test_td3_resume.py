"""TD3 end to end in one process (`configs/td3_pendulum.yaml`, shrunk): it learns (the critics' loss falls, the actor
steps every policy_delay-th update) and N iterations equal N/2, a stop and a resume, line for line and byte for byte.
Colocated and split layouts: tests/launchers/test_td3_layouts.py."""

from __future__ import annotations

import pytest
from harness.launch import ROOT
from harness.runs import assert_halves_equal_whole

TD3_TINY = [
    "--config",
    str(ROOT / "configs" / "td3_pendulum.yaml"),
    "algo.num_steps=4",
    "train.total_steps=320",
    "algo.learning_starts=64",
    "algo.batch_size=32",
    "policy.hidden_sizes=[32,32]",
    "algo.critic_hidden_sizes=[32,32]",
    "eval.every=0",
    "log.progress=false",
    "log.tensorboard=false",
]


@pytest.mark.slow
def test_td3_learns_and_resumes_exactly(tmp_path):
    records = assert_halves_equal_whole(TD3_TINY, tmp_path, 40)
    learning = [r for r in records if "qf_loss" in r]
    assert learning and "actor_loss" in learning[-1]
    assert learning[-1]["qf_loss"] < learning[0]["qf_loss"]
