"""End-to-end runs of `python -m spmd_rl.main`: one process, colocated ranks and a split layout under torchrun.

Small budgets: these prove the wiring (messages, DDP, weight sync, metrics), not learning curves; the learning
benchmarks live in benchmarks/.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "configs" / "ci_tiny.yaml")
REQUIRED_METRICS = {
    "iteration",
    "env_steps",
    "episode_return_mean",
    "episode_length_mean",
    "sps",
    "time_env_s",
    "time_inference_s",
    "time_transfer_s",
    "time_learn_s",
    "time_weight_sync_s",
}
PPO_METRICS = {"policy_loss", "value_loss", "entropy", "approx_kl", "clip_fraction", "explained_variance"}


def _env():
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1")
    env.pop("RANK", None)
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_main(*args, nproc: int = 0, timeout: float = 240) -> subprocess.CompletedProcess:
    if nproc:
        launcher = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=1",
            f"--nproc_per_node={nproc}",
            "--rdzv_backend=c10d",
            f"--rdzv_endpoint=127.0.0.1:{_free_port()}",
            "-m",
            "spmd_rl.main",
        ]
    else:
        launcher = [sys.executable, "-m", "spmd_rl.main"]
    return subprocess.run(launcher + list(args), cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def assert_run_complete(result, run_dir: Path, iterations: int, algo_metrics=PPO_METRICS) -> list[dict]:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    records = read_metrics(run_dir)
    assert [r["iteration"] for r in records] == list(range(iterations))
    assert REQUIRED_METRICS | algo_metrics <= set(records[-1])
    assert (run_dir / "config.yaml").is_file() and (run_dir / "policy.pt").is_file()
    assert "done:" in result.stdout
    return records


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
    result = run_main("--config", TINY, f"run.dir={tmp_path}", nproc=2)
    records = assert_run_complete(result, tmp_path, iterations=4)  # 2 ranks x 2 envs x 16 steps = 64 per iteration
    assert records[-1]["env_steps"] == 256


@pytest.mark.slow
def test_torchrun_split_layout_two_trainers_weights_verified_every_sync(tmp_path):
    # 5 ranks: 2 trainers (DDP), 1 inference server for 2 env ranks. weights.verify_every=1 compares checksums of
    # every inference rank's weights with trainer 0's after every sync, and fails the run on any difference.
    result = run_main(
        "--config",
        TINY,
        f"run.dir={tmp_path}",
        "layout.mode=split",
        "layout.trainer=2",
        "layout.inference=1",
        "layout.env=2",
        "weights.verify_every=1",
        nproc=5,
    )
    records = assert_run_complete(result, tmp_path, iterations=4)
    assert records[-1]["episodes"] > 0
    assert records[-1]["time_weight_sync_s"] > 0


SAC_TINY = [
    "--config",
    str(ROOT / "configs" / "sac_pendulum.yaml"),
    "algo.num_steps=4",
    "train.total_steps=96",
    "algo.learning_starts=32",
    "algo.batch_size=16",
    "policy.hidden_sizes=[16,16]",
    "log.progress=false",
    "log.tensorboard=false",
]


def test_sac_one_process_with_hdf5_replay_and_experience_log(tmp_path):
    result = run_main(*SAC_TINY, f"run.dir={tmp_path}", "buffer.backend=hdf5", "buffer.log_experience=true")
    assert_run_complete(result, tmp_path, iterations=24, algo_metrics={"qf_loss", "actor_loss", "alpha"})
    inspect = subprocess.run(
        [sys.executable, "-m", "spmd_rl.data", "inspect", str(tmp_path)],
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
    result = run_main(
        *SAC_TINY,
        f"run.dir={tmp_path}",
        "layout.mode=split",
        "layout.trainer=2",
        "layout.inference=1",
        "layout.env=2",
        "weights.verify_every=1",
        nproc=5,
    )
    assert_run_complete(result, tmp_path, iterations=12, algo_metrics={"qf_loss", "actor_loss", "alpha"})
