"""mpirun end to end (real Open MPI, real gloo): launch/mpirun.sh trains the tiny config colocated and split, and split
with the async engine within its lag bound; a job whose rank 1 crashes ends non-zero instead of hanging.

Skipped when mpirun or mpi4py is missing (.ci/install-system.sh installs Open MPI).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from harness.launch import command

REPO = Path(__file__).resolve().parents[2]
SPLIT_4 = ["layout.mode=split", "layout.trainer=1", "layout.inference=1", "layout.env=2"]
JOB_TIMEOUT_S = 180  # a bound for a hang, far above the few seconds a run takes on a quiet machine

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        shutil.which("mpirun") is None, reason="Open MPI's mpirun is not installed; run .ci/install-system.sh as root"
    ),
]


def run_job(command: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    """Run a launcher in its own session; on a hang, kill the whole session so no rank outlives the test."""
    job = subprocess.Popen(
        command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = job.communicate(timeout=JOB_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        output, _ = job.communicate()
        pytest.fail(f"{' '.join(command)} still running after {JOB_TIMEOUT_S} s (a hang); output:\n{output[-4000:]}")
    return subprocess.CompletedProcess(command, job.returncode, output)


def mpirun_env(ranks: int) -> dict[str, str]:
    return {
        **os.environ,
        "NP": str(ranks),
        "PYTHON": sys.executable,
        "PYTHONPATH": str(REPO),
        "GLOO_SOCKET_IFNAME": "lo",
    }


@pytest.mark.parametrize("layout", [[], SPLIT_4], ids=["colocated", "split"])
def test_mpirun_trains_the_tiny_config(tmp_path, layout):
    run_dir = tmp_path / "run"
    done = run_job(
        ["launch/mpirun.sh", "--config", "configs/ci_tiny.yaml", f"run.dir={run_dir}", *layout], mpirun_env(4)
    )
    assert done.returncode == 0, done.stdout[-4000:]
    assert "launcher mpi" in done.stdout
    metrics = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert metrics and all(json.loads(line) for line in metrics)


def test_mpirun_runs_the_async_engine_within_its_lag_bound(tmp_path):
    # 10 iterations of 2 env ranks at lag 2: env ranks run ahead of the trainer as far as the bound lets them.
    run_dir = tmp_path / "run"
    done = run_job(
        [
            "launch/mpirun.sh",
            "--config",
            "configs/ci_tiny.yaml",
            f"run.dir={run_dir}",
            *SPLIT_4,
            "train.total_steps=640",
            "engine.class=async",
            "engine.max_policy_lag=2",
            "algo.vtrace=true",
        ],
        mpirun_env(4),
    )
    assert done.returncode == 0, done.stdout[-4000:]
    assert "launcher mpi" in done.stdout and "async engine, max policy lag 2" in done.stdout, done.stdout[-4000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == list(range(10))
    assert all(0 <= r["policy_lag_mean"] <= r["policy_lag_max"] <= 2 for r in records), records


def test_mpirun_job_with_a_crashing_rank_fails(tmp_path):
    done = run_job(
        [
            "launch/mpirun.sh",
            "--config",
            "configs/ci_tiny.yaml",
            f"run.dir={tmp_path / 'run'}",
            "env.id=tests.harness.crashing_env:Crashing-v0",
            "dist.timeout_s=20",
        ],
        mpirun_env(2),
    )
    assert done.returncode != 0, done.stdout[-4000:]
    assert "deliberate failure on rank 1" in done.stdout, done.stdout[-4000:]


def test_mpi_rendezvous_with_the_probe(tmp_path):
    # The launch source alone, without training: every rank agrees on rank 0's address and joins one group.
    done = run_job(
        [*command("mpirun", 3, script="tests/harness/launch_probe.py"), f"run.dir={tmp_path}"],
        mpirun_env(3),
    )
    assert done.returncode == 0, done.stdout[-4000:]
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(3)]
    assert {report["init_method"] for report in reports} == {reports[0]["init_method"]}
    assert [
        (r["launcher"], r["rank"], r["world_size"], r["local_rank"], r["local_world_size"], r["rank_sum"])
        for r in reports
    ] == [("mpi", rank, 3, rank, 3, 6.0) for rank in range(3)]


@pytest.mark.parametrize(
    "how, victim, name",
    [(signal.SIGKILL, 1, "rank 1 (inference 0)"), (signal.SIGSTOP, 2, "rank 2 (env 0)")],
    ids=["killed", "stopped"],
)
def test_a_killed_or_stopped_rank_is_named_in_the_job_summary_although_mpirun_kills_rank_0(tmp_path, how, victim, name):
    # mpirun ends every rank as soon as one dies, often rank 0 before it printed the job summary; the ranks'
    # failure records (files in the launcher's directory) still give exactly one summary naming the killed rank.
    # A stopped rank: its peers time out and exit, and mpirun ends the job, waking the stopped rank with SIGCONT
    # before its SIGTERM; the woken rank finds every peer gone, and must not be blamed on rank 0.
    returncode, output = _split_job_with_a_fault(tmp_path, lambda pid: os.kill(pid, how), victim)
    summaries = [line for line in output.splitlines() if "job summary" in line]
    assert returncode != 0, output[-4000:]
    assert len(summaries) == 1, output[-4000:]
    assert summaries[0].startswith(f"spmd_rl: job summary: {name} stopped responding first"), output
    assert "stopping after this iteration" not in output, output[-4000:]  # mpirun's abort is no stop request


def _split_job_with_a_fault(tmp_path, fault, victim: int) -> tuple[int, str]:
    """Run the split-4 tiny config under launch/mpirun.sh, apply fault(pid) to rank `victim` after 3 iterations;
    the launcher's exit code and output."""
    run_dir = tmp_path / "run"
    command = [
        "launch/mpirun.sh",
        "--config",
        "configs/ci_tiny.yaml",
        f"run.dir={run_dir}",
        *SPLIT_4,
        "train.total_steps=200000",
        "dist.timeout_s=20",
    ]
    job = subprocess.Popen(
        command,
        cwd=REPO,
        env=mpirun_env(4),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + JOB_TIMEOUT_S
        metrics = run_dir / "metrics.jsonl"
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
            assert job.poll() is None and time.monotonic() < deadline, "the job ended or hung before 3 iterations"
            time.sleep(0.2)
        fault(_rank_pid(victim, str(run_dir)))
        output, _ = job.communicate(timeout=JOB_TIMEOUT_S)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.communicate()
    return job.returncode, output


def _rank_pid(rank: int, marker: str) -> int:
    """The pid of this job's rank `rank` (mpirun tells each rank its number in OMPI_COMM_WORLD_RANK)."""
    for proc in Path("/proc").iterdir():
        try:
            if (
                marker in (proc / "cmdline").read_text()
                and f"OMPI_COMM_WORLD_RANK={rank}\0" in (proc / "environ").read_text()
            ):
                return int(proc.name)
        except (OSError, ValueError):
            continue
    raise AssertionError(f"no process of rank {rank} with {marker} on its command line")
