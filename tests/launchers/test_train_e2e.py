"""End-to-end runs of `python -m spmd_rl.main`: one process, colocated ranks and a split layout under torchrun.

Small budgets: these prove the wiring (messages, DDP, weight sync, metrics), not learning curves; the learning
benchmarks live in benchmarks/.
"""

import subprocess
import sys

import numpy as np
import pytest
from harness.launch import ROOT
from harness.runs import SAC_TINY, TINY, assert_run_complete, assert_same_run, run_main

# 5 ranks split: 2 trainers, 1 inference rank for 2 env ranks; every inference rank's weights checked after each sync
SPLIT_5_VERIFIED = (
    "layout.mode=split",
    "layout.trainer=2",
    "layout.inference=1",
    "layout.env=2",
    "weights.verify_every=1",
)


def test_one_process_writes_metrics_config_policy_and_tensorboard(tmp_path):
    result = run_main("--config", TINY, f"run.dir={tmp_path}", "log.tensorboard=true")
    records = assert_run_complete(result, tmp_path, iterations=8)
    assert records[-1]["env_steps"] == 256
    assert any(p.name.startswith("events.out.tfevents") for p in (tmp_path / "tensorboard").iterdir())
    # Every finite value of every metrics line is a TensorBoard scalar at its env_steps, as add_scalar writes it.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    expected = {
        (key, record["env_steps"]): float(np.float32(value))
        for record in records
        for key, value in record.items()
        if key not in ("iteration", "env_steps") and value is not None and np.isfinite(value)
    }
    written = {(tag, e.step): e.value for tag in events.Tags()["scalars"] for e in events.Scalars(tag)}
    assert written == expected


def test_one_process_learns_cartpole_clearly_above_random(tmp_path):
    # A random policy averages ~22 on CartPole-v1; the default config passes 100 well before 12k steps.
    result = run_main(f"run.dir={tmp_path}", "train.total_steps=12000", "log.progress=false", "log.tensorboard=false")
    records = assert_run_complete(result, tmp_path, iterations=46)
    assert records[-1]["episode_return_mean"] > 100


@pytest.mark.slow
def test_torchrun_colocated_two_ranks_data_parallel(tmp_path):
    result = run_main("--config", TINY, f"run.dir={tmp_path}", nproc=2, launcher="torchrun")
    records = assert_run_complete(result, tmp_path, iterations=4)  # 2 ranks x 2 envs x 16 steps = 64 per iteration
    assert records[-1]["env_steps"] == 256


@pytest.mark.slow
def test_ranks_forked_by_the_test_harness_train_exactly_as_torchruns_do(tmp_path):
    # The tests about runs start their ranks forked from a warm interpreter (harness/forked.py): the same split job
    # under torchrun must give the same records (timings aside) and the same final weights, bit for bit.
    split = ["layout.mode=split", "layout.trainer=1", "layout.inference=1", "layout.env=2"]
    for launcher in ("torchrun", "forked"):
        result = run_main("--config", TINY, *split, f"run.dir={tmp_path / launcher}", nproc=4, launcher=launcher)
        assert result.returncode == 0, result.stderr[-3000:]
    assert_same_run(tmp_path / "torchrun", tmp_path / "forked")


@pytest.mark.slow
def test_torchrun_split_layout_two_trainers_weights_verified_every_sync(tmp_path):
    # 5 ranks: 2 trainers (DDP), 1 inference server for 2 env ranks. weights.verify_every=1 compares checksums of
    # every inference rank's weights with trainer 0's after every sync, and fails the run on any difference.
    result = run_main("--config", TINY, f"run.dir={tmp_path}", *SPLIT_5_VERIFIED, nproc=5, launcher="torchrun")
    records = assert_run_complete(result, tmp_path, iterations=4)
    assert records[-1]["episodes"] > 0
    assert records[-1]["time_weight_sync_s"] > 0


def test_sac_one_process_with_hdf5_replay_and_experience_log(tmp_path):
    result = run_main(*SAC_TINY, f"run.dir={tmp_path}", "buffer.backend=hdf5", "buffer.log_experience=true")
    assert_run_complete(result, tmp_path, iterations=24, algo_metrics={"qf_loss", "actor_loss", "alpha"})
    inspect = subprocess.run(
        [sys.executable, "-m", "spmd_rl.experience", "inspect", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert inspect.returncode == 0, inspect.stderr
    assert "experience_rank0.h5" in inspect.stdout and "replay_rank0.h5" in inspect.stdout


@pytest.mark.slow
def test_sac_torchrun_split_two_trainer_shards(tmp_path):
    # 5 ranks: 2 trainers (each with its replay shard, gradients averaged), 1 inference server, 2 env ranks.
    result = run_main(*SAC_TINY, f"run.dir={tmp_path}", *SPLIT_5_VERIFIED, nproc=5, launcher="torchrun")
    assert_run_complete(result, tmp_path, iterations=12, algo_metrics={"qf_loss", "actor_loss", "alpha"})
