"""Runs of an instructed env (tests/harness/instructed_env.py: an image, a state and a Text instruction in a Dict,
a success flag in the step info): PPO in one process reaches the end with success metrics and learns to read the
instruction; the token ids travel from an env rank over the wire in the split layout; bad input is one line, exit 2."""

from __future__ import annotations

import subprocess
import sys

import h5py
import numpy as np
from harness.launch import ROOT, job_env
from harness.runs import TINY, assert_one_line_exit_2, assert_run_complete, read_metrics, run_main

ENV = "env.id=tests.harness.instructed_env:Instructed-v0"
SUCCESS = {"success_rate", "success_at_end_rate"}


def test_ppo_in_one_process_reports_success_and_learns_the_instruction(tmp_path):
    run_dir = tmp_path / "run"
    result = run_main(
        "--config", TINY, ENV, f"run.dir={run_dir}", "env.num_envs=4", "algo.num_steps=32",
        "train.total_steps=8192", "eval.every=64", "eval.episodes=20", "log.interval_s=0",
    )  # fmt: skip
    records = assert_run_complete(result, run_dir, 64)
    assert all(SUCCESS <= set(record) for record in records)
    assert all(0.0 <= record["success_at_end_rate"] <= record["success_rate"] <= 1.0 for record in records)
    assert "success " in result.stdout  # the console line
    # Only the instruction tells the targets apart: a deterministic policy that always succeeds has read it.
    assert records[-1]["eval_success_rate"] == 1.0 and records[-1]["eval_return_mean"] == 4.0

    evaluated = subprocess.run(
        [sys.executable, "-m", "spmd_rl.evaluate", str(run_dir), "--episodes", "20"],
        cwd=ROOT, env=job_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert evaluated.returncode == 0, evaluated.stderr[-2000:]
    assert "success 1.00 (95% interval 0.84-1.00), at the end 1.00" in evaluated.stdout


def test_classic_envs_get_no_success_keys(tmp_path):
    run_dir = tmp_path / "run"
    result = run_main("--config", TINY, f"run.dir={run_dir}", "train.total_steps=64")
    records = assert_run_complete(result, run_dir, 2)
    assert not any(SUCCESS & set(record) for record in records)


def test_token_ids_travel_from_an_env_rank_in_the_split_layout(tmp_path):
    run_dir = tmp_path / "run"
    result = run_main(
        "--config", TINY, ENV, f"run.dir={run_dir}", "layout.mode=split", "layout.trainer=1", "layout.inference=1",
        "layout.env=1", "train.total_steps=128", "buffer.log_experience=true",
        nproc=3,
    )  # fmt: skip
    records = assert_run_complete(result, run_dir, 4)
    assert SUCCESS <= set(records[-1])
    with h5py.File(run_dir / "buffer" / "experience_rank0.h5", "r") as file:
        ids, mask = file["data/obs/instruction/ids"][:], file["data/obs/instruction/mask"][:]
    assert ids.dtype == np.uint8 and ids.shape[1:] == (64,) and len(ids) == 128
    texts = {bytes(row[m.astype(bool)]).decode() for row, m in zip(ids, mask)}
    assert texts == {"reach the red target", "reach the blue target"}


def test_success_per_env_group_over_two_colocated_trainers(tmp_path):
    run_dir = tmp_path / "run"
    result = run_main(
        "--config", TINY, ENV, f"run.dir={run_dir}", "train.total_steps=256",
        "env.groups=[{name: plain, num_envs: 1}, {name: polite, num_envs: 1, kwargs: {instruction_suffix: ' now'}}]",
        nproc=2,
    )  # fmt: skip
    records = assert_run_complete(result, run_dir, 4)
    # Every env (2 per rank, 2 ranks) ends an episode at its steps 4, 9, 14, ... (4 steps, then the reset step):
    # the episode counts of both trainers' envs were gathered.
    assert [record["episodes"] for record in records] == [12, 24, 36, 52]
    for record in records:
        for suffix in ("", "/plain", "/polite"):
            assert 0.0 <= record[f"success_at_end_rate{suffix}"] <= record[f"success_rate{suffix}"] <= 1.0


def test_text_longer_than_max_text_tokens_stops_before_any_rollout(tmp_path):
    result = run_main("--config", TINY, ENV, f"run.dir={tmp_path / 'run'}", "env.max_text_tokens=16")
    assert_one_line_exit_2(result, "longer than env.max_text_tokens=16", "set env.max_text_tokens=2")
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or not read_metrics(tmp_path / "run")


def test_a_tokenizer_path_that_does_not_exist(tmp_path):
    result = run_main("--config", TINY, ENV, f"env.tokenizer={tmp_path / 'nowhere'}")
    assert_one_line_exit_2(result, "env.tokenizer=", "nowhere: no such file or folder")


def test_a_success_key_the_info_lacks(tmp_path):
    result = run_main("--config", TINY, "env.success_key=is_success")
    assert_one_line_exit_2(result, "env.success_key=is_success", "no such key in its step info")


def test_a_policy_whose_action_is_not_the_action_space_s():
    result = run_main(
        "--config", TINY, "env.id=Pendulum-v1", "policy.class=tests.harness.chunk_policy:ChunkDeclaringActorCritic"
    )  # fmt: skip
    assert_one_line_exit_2(result, "declares 'action' of shape (4, 1)", "takes actions of shape (1,)")
