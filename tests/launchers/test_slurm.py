"""Slurm end to end on a throw-away cluster (real slurmctld + slurmd on this host, see tests/harness/slurm_cluster.py):
`sbatch slurm/train.sh` (torchrun per node) and `sbatch slurm/train_srun.sh` (one srun task per rank) train the tiny
config, train_srun.sh also split by role under the async engine (within its lag bound); a 2-node job runs across
two emulated nodes; a job whose rank 1 crashes ends FAILED instead of hanging.
Preemption: a train.sh job warned of its time limit (SIGUSR1 to the batch script) and a train_srun.sh job preempted
by a job of a higher partition (SIGTERM to its ranks) each stop with a checkpoint, requeue themselves, resume in the
same run directory and complete.

Skipped when the Slurm binaries are absent (.ci/install-system.sh installs them).
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import pytest
from harness.slurm_cluster import FINISHED_STATES, SlurmCluster, slurm_cluster_fixture

REPO = Path(__file__).resolve().parents[2]
JOB_TIMEOUT_S = 180  # a bound for a hang, far above the seconds a job takes on a quiet machine


@pytest.fixture(scope="module")
def one_node(tmp_path_factory):
    yield from slurm_cluster_fixture(tmp_path_factory, node_count=1)


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    yield from slurm_cluster_fixture(tmp_path_factory, node_count=2)


@pytest.fixture(scope="module")
def preemptible(tmp_path_factory):
    yield from slurm_cluster_fixture(tmp_path_factory, node_count=1, preemption=True)


def submit_only(
    cluster: SlurmCluster,
    script: str,
    run_dir: Path,
    *overrides: str,
    sbatch_options: tuple[str, ...] = (),
    ranks_per_node: int = 2,
) -> str:
    """sbatch a training script on the tiny config; returns the job id."""
    env = {
        "PYTHON": sys.executable,
        "PYTHONPATH": str(REPO),
        "GLOO_SOCKET_IFNAME": "lo",
        "RANKS_PER_NODE": str(ranks_per_node),
    }
    return cluster.submit(
        REPO / script,
        "configs/ci_tiny.yaml",
        f"run.dir={run_dir}",
        *overrides,
        sbatch_options=sbatch_options,
        env=env,
        cwd=REPO,
    )


def submit(cluster: SlurmCluster, script: str, run_dir: Path, *overrides: str, **options):
    """sbatch a training script on the tiny config and wait for the job to leave the queue."""
    return cluster.wait_job(submit_only(cluster, script, run_dir, *overrides, **options), JOB_TIMEOUT_S)


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


def test_sbatch_train_srun_sh_runs_one_task_per_rank(one_node, tmp_path):
    job = submit(one_node, "slurm/train_srun.sh", tmp_path / "run", sbatch_options=("--ntasks-per-node=2",))
    assert_trained(job, tmp_path / "run", "slurm")


def test_sbatch_train_sh_across_two_nodes(two_nodes, tmp_path):
    job = submit(two_nodes, "slurm/train.sh", tmp_path / "run", sbatch_options=("--nodes=2",), ranks_per_node=2)
    assert_trained(job, tmp_path / "run", "torchrun")
    assert "world size 4" in _all_output(job, tmp_path / "run")


@pytest.mark.slow  # tens of seconds; the quick run covers the async engine under torchrun (launchers/test_async.py)
def test_sbatch_train_srun_sh_runs_the_async_engine_within_its_lag_bound(one_node, tmp_path):
    # One srun task per rank, split by role (1 trainer, 1 inference, 2 env ranks), 10 iterations at lag 2.
    run_dir = tmp_path / "run"
    job = submit(
        one_node,
        "slurm/train_srun.sh",
        run_dir,
        "layout.mode=split",
        "layout.trainer=1",
        "layout.inference=1",
        "layout.env=2",
        "train.total_steps=640",
        "engine.class=async",
        "engine.max_policy_lag=2",
        "algo.vtrace=true",
        sbatch_options=("--ntasks-per-node=4",),
    )
    assert_trained(job, run_dir, "slurm")
    assert "async engine, max policy lag 2" in job.output, job.output[-4000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == list(range(10))
    assert all(0 <= r["policy_lag_mean"] <= r["policy_lag_max"] <= 2 for r in records), records


def test_srun_job_with_a_crashing_rank_fails(one_node, tmp_path):
    job = submit(
        one_node,
        "slurm/train_srun.sh",
        tmp_path / "run",
        "env.id=tests.harness.crashing_env:Crashing-v0",
        "dist.timeout_s=20",
        sbatch_options=("--ntasks-per-node=2",),
    )
    assert job.state == "FAILED" and job.exit_code != "0:0", (job.state, job.exit_code, job.output[-4000:])
    assert "deliberate failure on rank 1" in job.output, job.output[-4000:]


# Long enough that the job is still running when it is signalled after its first checkpoint: 150 iterations of 64 env
# steps with 2 ranks (tens of seconds), a checkpoint every 5.
PREEMPTIBLE_RUN = ("train.total_steps=9600", "checkpoint.every_iterations=5")
PREEMPTIBLE_ITERATIONS = 150


@pytest.mark.slow
def test_train_sh_warned_of_its_time_limit_checkpoints_requeues_and_resumes(one_node, tmp_path):
    run_dir = tmp_path / "run"
    job_id = submit_only(one_node, "slurm/train.sh", run_dir, *PREEMPTIBLE_RUN, ranks_per_node=2)
    wait_for_checkpoint(one_node, job_id, run_dir)
    # What --signal=B:USR1@120 sends 120 s before the time limit: SIGUSR1 to the batch script alone.
    signalled = one_node.run("scancel", "--batch", "--signal=USR1", job_id)
    assert signalled.returncode == 0, signalled.stderr
    job = resume_requeued(one_node, job_id)
    assert_preempted_and_resumed(job, run_dir, "SIGUSR1")


@pytest.mark.slow
def test_train_srun_sh_preempted_by_a_higher_partition_checkpoints_requeues_and_resumes(preemptible, tmp_path):
    run_dir = tmp_path / "run"
    # Two ranks holding all 8 CPUs of the node, so that a job of the `high` partition preempts them.
    job_id = submit_only(
        preemptible,
        "slurm/train_srun.sh",
        run_dir,
        *PREEMPTIBLE_RUN,
        sbatch_options=("--ntasks-per-node=2", "--cpus-per-task=4"),
    )
    wait_for_checkpoint(preemptible, job_id, run_dir)
    # A real preemption: Slurm sends SIGTERM to every process of the job's steps and gives them a grace time.
    preemptor = preemptible.run(
        "sbatch", "--parsable", "--partition=high", "--ntasks=1", "--output=/dev/null", "--wrap=true"
    )
    assert preemptor.returncode == 0, preemptor.stderr
    job = resume_requeued(preemptible, job_id)
    assert_preempted_and_resumed(job, run_dir, "SIGTERM")


def wait_for_checkpoint(cluster: SlurmCluster, job_id: str, run_dir: Path) -> None:
    latest = run_dir / "checkpoints" / "latest"
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while not latest.exists():
        if time.monotonic() > deadline or not cluster.run("squeue", "-h", "-j", job_id).stdout.strip():
            pytest.fail(f"job {job_id} wrote no checkpoint:\n{cluster.job_output(job_id)[-4000:]}")
        time.sleep(0.2)


def resume_requeued(cluster: SlurmCluster, job_id: str):
    """Wait until the job requeued itself, let it start soon (Slurm holds a requeued job for 2 minutes), and wait
    for it to leave the queue."""
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while (
        (fields := cluster.job_fields(job_id)).get("Restarts") == "0"
        or fields.get("JobState") != "PENDING"
        or set(cluster.run("sinfo", "-h", "-N", "-o", "%T").stdout.split()) != {"idle"}
    ):
        if time.monotonic() > deadline or fields.get("JobState") in FINISHED_STATES:
            pytest.fail(
                f"job {job_id} was not requeued ({fields.get('JobState')}):\n{cluster.job_output(job_id)[-4000:]}"
            )
        time.sleep(0.2)
    # The node is idle, the previous run cleaned up. slurmd revoked that run's credential, and refuses a launch of
    # the same job id within the same second ("Job credential revoked", the job then FAILS): start 2 s later.
    time.sleep(2)
    released = cluster.run("scontrol", "update", f"JobId={job_id}", "StartTime=now")
    assert released.returncode == 0, released.stderr
    return cluster.wait_job(job_id, JOB_TIMEOUT_S)


def assert_preempted_and_resumed(job, run_dir: Path, signal_name: str) -> None:
    output = _all_output(job, run_dir)
    assert (job.state, job.exit_code) == ("COMPLETED", "0:0"), output[-4000:]
    stopped = re.search(rf"stopped by {signal_name} after iteration (\d+)", output)
    assert stopped, output[-4000:]
    assert f"resuming from {run_dir}/checkpoints/iter_{int(stopped[1]):09d}" in output, output[-4000:]
    assert "requeued to resume" in job.output
    assert (run_dir / "finished.json").is_file()
    iterations = [json.loads(line)["iteration"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert iterations == list(range(PREEMPTIBLE_ITERATIONS))  # each once: the resumed run continued the records
