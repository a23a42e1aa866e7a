"""`python -m spmd_rl.collect --policy RUN` on an env whose observation is one Box (Pendulum), not a Dict: its rows go
to /data/obs. The empty key made the dataset name 'obs/', and collect refused with exit 2, "cannot create: Unable to
synchronously create dataset (name parameter cannot be an empty string)", blaming the output file (fault pass 4, L3)."""

from __future__ import annotations

import subprocess
import sys

from harness.forked import run_forked_process
from harness.launch import ROOT, job_env

from spmd_rl.storage.reader import HDF5Reader

PENDULUM = "configs/ppo_pendulum.yaml"


def test_collect_with_a_policy_writes_a_box_observation_to_data_obs(tmp_path):
    run_dir, out = tmp_path / "run", tmp_path / "demos.h5"
    trained = run_forked_process(["--config", PENDULUM, f"run.dir={run_dir}", "train.total_steps=4096"])
    assert trained.returncode == 0, trained.stderr[-3000:]
    line = [sys.executable, "-m", "spmd_rl.collect", "--config", PENDULUM, "--policy", str(run_dir)]
    done = subprocess.run(
        [*line, "--episodes", "2", "--out", str(out)], cwd=ROOT, env=job_env(), capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "holds 2 episodes" in done.stdout, done.stdout
    with HDF5Reader(out) as reader:
        rows = reader.read()
    assert rows["obs"].shape == (400, 3) and rows["action"].shape == (400, 1)  # Pendulum: 200 steps an episode
