"""TD3 (`algo.class: td3`) under torchrun: colocated 2 ranks (with ddp and with fsdp trainers) and split 4 (the
inference rank serves the deterministic actor plus its exploration noise), each N iterations equal to N/2, a stop
and a resume (line for line, weights byte for byte). One process: tests/runs/test_td3_resume.py."""

from __future__ import annotations

import pytest
from harness.launch import ROOT
from harness.runs import SPLIT4, assert_halves_equal_whole

TD3_TINY = [
    "--config",
    str(ROOT / "configs" / "td3_pendulum.yaml"),
    "env.num_envs=2",
    "algo.num_steps=4",
    "train.total_steps=320",
    "algo.learning_starts=64",
    "algo.batch_size=16",
    "policy.hidden_sizes=[16,16]",
    "algo.critic_hidden_sizes=[16,16]",
    "eval.every=0",
    "log.progress=false",
    "log.tensorboard=false",
]
CASES = {
    "colocated-2": ([], 2, 10),  # 2 envs per rank: 16 steps an iteration, 20 iterations
    "colocated-2-fsdp": (["train.parallel=fsdp"], 2, 10),
    "split-4": (SPLIT4, 4, 10),  # 2 env ranks of 2 envs
}


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_n_iterations_equal_half_then_resume(tmp_path, case):
    extra, nproc, half = CASES[case]
    args = [*TD3_TINY, *extra]
    assert "actor_loss" in assert_halves_equal_whole(args, tmp_path, half, nproc=nproc)[-1]
