"""Slurm end to end on a throw-away cluster (real slurmctld + slurmd on this host, see tests/slurm_cluster.py):
`sbatch slurm/train.sh` (torchrun per node) and `sbatch slurm/train_srun.sh` (one srun task per rank) train the tiny
config; the preemption hook logs SIGUSR1 without stopping the run; a 2-node job runs across two emulated nodes; a
job whose rank 1 crashes ends FAILED instead of hanging.

Skipped when the Slurm binaries are absent (.ci/install-system.sh installs them).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from slurm_cluster import SlurmCluster, slurm_cluster_fixture

REPO = Path(__file__).resolve().parents[1]
JOB_TIMEOUT_S = 180  # a bound for a hang, far above the seconds a job takes on a quiet machine


@pytest.fixture(scope="module")
def one_node(tmp_path_factory):
    yield from slurm_cluster_fixture(tmp_path_factory, node_count=1)


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    yield from slurm_cluster_fixture(tmp_path_factory, node_count=2)


def submit_only(cluster: SlurmCluster, script: str, run_dir: Path, *overrides: str,
                sbatch_options: tuple[str, ...] = (), ranks_per_node: int = 2) -> str:
    """sbatch a training script on the tiny config; returns the job id."""
    env = {"PYTHON": sys.executable, "PYTHONPATH": str(REPO), "GLOO_SOCKET_IFNAME": "lo",
           "RANKS_PER_NODE": str(ranks_per_node)}
    return cluster.submit(REPO / script, "configs/ci_tiny.yaml", f"run.dir={run_dir}", *overrides,
                          sbatch_options=sbatch_options, env=env, cwd=REPO)


def submit(cluster: SlurmCluster, script: str, run_dir: Path, *overrides: str, **options):
    """sbatch a training script on the tiny config and wait for the job to leave the queue."""
    return cluster.wait_job(submit_only(cluster, script, run_dir, *overrides, **options), JOB_TIMEOUT_S)


def wait_for_output(cluster: SlurmCluster, job_id: str, text: str) -> None:
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while text not in cluster.job_output(job_id):
        if time.monotonic() > deadline or not cluster.run("squeue", "-h", "-j", job_id).stdout.strip():
            pytest.fail(f"job {job_id} never printed {text!r}:\n{cluster.job_output(job_id)[-4000:]}")
        time.sleep(0.2)


def assert_trained(job, run_dir: Path, launcher: str) -> None:
    assert (job.state, job.exit_code) == ("COMPLETED", "0:0"), job.output[-4000:]
    assert f"launcher {launcher}" in _all_output(job, run_dir)
    metrics = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert metrics and all(json.loads(line) for line in metrics)
    assert (run_dir / "logs" / f"slurm-{job.job_id}.out").exists()  # the batch log is linked into the run dir


def _all_output(job, run_dir: Path) -> str:
    # train.sh tees each rank's output into run_dir/logs/torchrun/ as well as the batch log
    rank_logs = sorted((run_dir / "logs").rglob("*.log"))
    return job.output + "".join(path.read_text() for path in rank_logs)


def test_sbatch_train_sh_runs_torchrun_on_one_node(one_node, tmp_path):
    job = submit(one_node, "slurm/train.sh", tmp_path / "run", ranks_per_node=2)
    assert_trained(job, tmp_path / "run", "torchrun")


def test_sbatch_train_srun_sh_runs_one_task_per_rank_and_survives_the_preemption_signal(one_node, tmp_path):
    job_id = submit_only(one_node, "slurm/train_srun.sh", tmp_path / "run", sbatch_options=("--ntasks-per-node=2",))
    # What Slurm does 120 s before the time limit (--signal=B:USR1@120), sent as soon as the script announced its
    # start (its trap is set by then) while the ranks are still starting: the hook logs, the run goes on.
    wait_for_output(one_node, job_id, "run dir")
    signalled = one_node.run("scancel", "--batch", "--signal=USR1", job_id)
    assert signalled.returncode == 0, signalled.stderr
    job = one_node.wait_job(job_id, JOB_TIMEOUT_S)
    assert_trained(job, tmp_path / "run", "slurm")
    assert "SIGUSR1 (time limit or preemption ahead)" in job.output, job.output[-4000:]


def test_sbatch_train_sh_across_two_nodes(two_nodes, tmp_path):
    job = submit(two_nodes, "slurm/train.sh", tmp_path / "run", sbatch_options=("--nodes=2",), ranks_per_node=2)
    assert_trained(job, tmp_path / "run", "torchrun")
    assert "world size 4" in _all_output(job, tmp_path / "run")


def test_srun_job_with_a_crashing_rank_fails(one_node, tmp_path):
    job = submit(one_node, "slurm/train_srun.sh", tmp_path / "run", "env.id=tests.crashing_env:Crashing-v0",
                 "dist.timeout_s=20", sbatch_options=("--ntasks-per-node=2",))
    assert job.state == "FAILED" and job.exit_code != "0:0", (job.state, job.exit_code, job.output[-4000:])
    assert "deliberate failure on rank 1" in job.output, job.output[-4000:]
