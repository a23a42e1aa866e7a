"""The MetaWorld recipe end to end at a tiny size, with the configs of configs/metaworld as they are: the scripted
expert's episodes of reach-v3 collected to HDF5, SFT (algo.class bc) on them, then GRPO from the SFT run with
run.init_from, on real MetaWorld envs rendering their camera (docs/sft.md, "MetaWorld")."""

from __future__ import annotations

import pytest
import torch
from harness.launch import ROOT
from harness.runs import read_metrics, run_main

from spmd_rl.collect import main as collect_main

pytest.importorskip("metaworld", reason='MetaWorld is not installed (pip install -e ".[metaworld]")')

CONFIGS = ROOT / "configs" / "metaworld"
QUIET = ["log.progress=false", "log.tensorboard=false"]
SHORT = "env.max_episode_steps=24"  # 6 decisions: SFT's evaluation and GRPO's episodes end soon


@pytest.mark.slow
def test_reach_collect_then_sft_then_grpo_from_its_checkpoint(tmp_path):
    demos = tmp_path / "reach.h5"
    # In this process (the command's own main), which saves one start-up of torch and MetaWorld.
    assert collect_main(["--config", str(CONFIGS / "reach_collect.yaml"), "--episodes", "2", "--out", str(demos)]) == 0

    sft = tmp_path / "sft"
    result = run_main(
        "--config", str(CONFIGS / "reach_sft.yaml"), *QUIET, f"algo.demos={demos}", "algo.iterations=3",
        "env.num_envs=2", SHORT, "eval.every=3", "eval.episodes=2", f"run.dir={sft}",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    records = read_metrics(sft)
    assert records[0]["demo_episodes"] == 2 and records[0]["demo_decisions"] > 2  # both episodes, every decision
    assert records[-1]["nll_loss"] < records[0]["nll_loss"]
    assert 0.0 <= records[-1]["eval_success_rate"] <= 1.0 and all(record["env_steps"] == 0 for record in records)

    # One GRPO iteration (no dynamic sampling: one rollout), one group of 4 from one task configuration, at
    # learning rate 0: it acts and updates with the SFT weights, which it keeps (its policy.pt is the SFT run's).
    grpo = tmp_path / "grpo"
    result = run_main(
        "--config", str(CONFIGS / "reach_grpo.yaml"), *QUIET, f"run.init_from={sft}", "algo.learning_rate=0",
        "algo.filter_groups=false",
        "env.num_envs=4", "env.group_size=4", SHORT, "train.total_steps=96",
        "eval.every=0", f"run.dir={grpo}",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    [record] = read_metrics(grpo)
    assert 0 < record["env_steps"] <= 4 * 24 and "success_rate" in record
    before, after = torch.load(sft / "policy.pt"), torch.load(grpo / "policy.pt")
    assert before.keys() == after.keys() and all(torch.equal(before[key], after[key]) for key in before)
