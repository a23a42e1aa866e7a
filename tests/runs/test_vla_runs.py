"""PPO with the vla policy through `python -m spmd_rl.main`: a tiny PaliGemma folder made here (sharded safetensors),
an instructed reaching env with camera image, state and instruction ids. In one process with LoRA (stopped after an
iteration and resumed; policy.pt merged, loaded back by load_policy); split over 5 ranks with the bins head, LoRA
(policy.pt as adapters), two fsdp trainers and bf16, the policy built once on trainer 0 and the inference rank, and
never on trainer 1 (its shards come from trainer 0's build) or an env rank; a bad folder is one line and exit 2."""

from __future__ import annotations

import json

import pytest
import torch
from harness.runs import TINY, assert_one_line_exit_2, assert_run_complete, run_main
from harness.vla_fixtures import InstructedReach, make_model_folder

from spmd_rl.modules.vla import VLAPolicy
from spmd_rl.persist.run_files import FINISHED
from spmd_rl.run.policies import load_policy

ENV = "env.id=tests.harness.vla_fixtures:InstructedReach-v0"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_model_folder(tmp_path_factory.mktemp("paligemma"))


def test_ppo_fine_tunes_lora_adapters_in_one_process_resumes_and_writes_policy_pt_merged(folder, tmp_path):
    args = [
        "--config", TINY, f"run.dir={tmp_path}", ENV, "policy.class=vla", f"policy.pretrained={folder}",
        "policy.lora.rank=4", "train.total_steps=96",
    ]  # fmt: skip
    stopped = run_main(*args, "run.stop_after_iterations=1")
    assert stopped.returncode == 75, stopped.stderr[-3000:]
    result = run_main(*args)  # resumes from the checkpoint: base and adapters
    assert "resuming from" in result.stdout, result.stdout[-3000:]
    records = assert_run_complete(result, tmp_path, iterations=3)
    assert records[-1]["episodes"] > 0 and records[-1]["approx_kl"] > 0
    state = torch.load(tmp_path / "policy.pt")
    assert not any(".lora_" in key for key in state) and "backbone.lm_head.weight" in state
    policy, cfg = load_policy(tmp_path)  # the merged file reads back into the LoRA policy the config builds
    assert isinstance(policy, VLAPolicy) and cfg.policy.lora.rank == 4
    obs, _ = InstructedReach().reset(seed=0)  # one observation as gymnasium gives it
    assert policy.act(obs, deterministic=True)["action"].shape == (2,)


@pytest.mark.slow
def test_ppo_trains_the_bins_head_with_lora_on_two_fsdp_trainers_in_bf16_split_over_5_ranks(folder, tmp_path):
    result = run_main(
        "--config", TINY, f"run.dir={tmp_path}", ENV, "policy.class=vla", f"policy.pretrained={folder}",
        "policy.action_head=bins", "policy.lora.rank=4", "policy.lora.save=adapters", "train.parallel=fsdp",
        "train.precision=bf16", "inference.dtype=bf16", "layout.mode=split", "layout.trainer=2",
        "layout.inference=1", "layout.env=2", "weights.verify_every=1",
        "dist.timeout_s=300",  # each building rank imports transformers (seconds of CPU each) within that bound
        nproc=5,
    )  # fmt: skip
    records = assert_run_complete(result, tmp_path, iterations=4)
    assert records[-1]["episodes"] > 0 and records[-1]["time_weight_sync_s"] > 0
    state = torch.load(tmp_path / "policy.pt")
    assert state and all(".lora_" in key or not key.startswith("backbone.") for key in state)
    ranks = json.loads((tmp_path / FINISHED).read_text())["ranks"]  # env ranks never build the policy
    assert [(r["role"], r["policy_builds"]) for r in ranks] == [("trainer", 1), ("trainer", 0), ("inference", 1)] + [
        ("env", 0)
    ] * 2
    # nor import its backbone's library: their spec came from rank 0 (a policy that acts on the wrong action shape
    # is refused on every rank: tests/runs/test_policy_builds.py)
    assert [r["transformers_imported"] for r in ranks] == [True] * 3 + [False] * 2


def test_a_pretrained_folder_without_config_json_is_one_line_and_exit_2(tmp_path):
    (tmp_path / "model").mkdir()
    result = run_main("--config", TINY, ENV, "policy.class=vla", f"policy.pretrained={tmp_path / 'model'}")
    assert_one_line_exit_2(result, "policy.pretrained=", "holds no config.json")
