"""How a person stops a run under plain `mpirun` and under `sbatch` + `scancel` (issue 27), measured end to end on
real launchers: what reaches the ranks, whether they save their checkpoint, the exit code or job state, and the
exit code rank 0 leaves in run.lock (what `python -m spmd_rl.runs` shows). The numbers these tests print (-s) are the
ones docs/runs.md quotes.

Plain mpirun (Open MPI 4.1) treats SIGINT and SIGTERM as "abort the job": it passes SIGTERM to the ranks about a
second later (odls_base_sigkill_timeout), SIGKILLs them a second after that, and exits 1 whatever they return. So a
Ctrl-C saves the checkpoint only when the iteration in flight and the checkpoint fit in that second; SIGUSR1 is
passed on at once, waits for the ranks and exits with their code (75). Under Slurm, scancel sends SIGTERM to every
process of the job's steps (the ranks hear it directly) and SIGKILL KillWait seconds later (30 by default): the ranks
stop with their checkpoint and the job is not requeued (a person cancelled it).

Skipped without mpirun or the Slurm binaries (.ci/install-system.sh installs both)."""

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
from harness.slurm_cluster import missing_slurm_binaries, slurm_cluster_fixture

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "ci_tiny.yaml"
LONG_RUN = ("train.total_steps=200000", "checkpoint.every_iterations=5")  # still running when signalled
JOB_TIMEOUT_S = 240

pytestmark = pytest.mark.slow


def wait_for(path: Path, alive, what: str) -> None:
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while not path.exists():
        if time.monotonic() > deadline or not alive():
            pytest.fail(f"no {what} ({path}) within {JOB_TIMEOUT_S} s or the job ended")
        time.sleep(0.2)


def exit_recorded(run_dir: Path):
    return json.loads((run_dir / "run.lock").read_text()).get("exit_code")


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="Open MPI's mpirun is not installed")
@pytest.mark.parametrize("signum", [signal.SIGUSR1, signal.SIGINT], ids=["SIGUSR1", "SIGINT"])
def test_plain_mpirun_signalled_as_a_terminal_does(tmp_path, signum):
    run_dir = tmp_path / "run"
    command = ["mpirun", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-n", "2", sys.executable]
    command += ["-m", "spmd_rl.main", "--config", str(TINY), f"run.dir={run_dir}", *LONG_RUN]
    env = {**os.environ, "PYTHONPATH": str(REPO), "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    job = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           start_new_session=True)  # fmt: skip
    try:
        wait_for(run_dir / "checkpoints" / "latest", lambda: job.poll() is None, "first checkpoint")
        signalled = time.monotonic()
        os.killpg(job.pid, signum)  # the whole group, as a terminal's Ctrl-C or `timeout -s USR1` does
        output, _ = job.communicate(timeout=JOB_TIMEOUT_S)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    took = time.monotonic() - signalled
    stops = [line for line in output.splitlines() if "stopped by" in line]
    print(f"\nplain mpirun, group {signum.name}: exit {job.returncode} after {took:.1f} s; {stops}; "
          f"run.lock exit_code {exit_recorded(run_dir)}")  # fmt: skip
    if signum == signal.SIGUSR1:  # passed on at once; mpirun waits for the ranks and returns their code
        assert job.returncode == 75, output[-3000:]
        assert len(stops) == 1 and "stopped by SIGUSR1" in stops[0]
        assert exit_recorded(run_dir) == 75
    else:  # mpirun's own abort: exit 1 whatever the ranks return; they may have been SIGKILLed
        assert job.returncode == 1, output[-3000:]


@pytest.fixture(scope="module")
def one_node(tmp_path_factory):
    yield from slurm_cluster_fixture(tmp_path_factory, node_count=1)


@pytest.mark.skipif(bool(missing_slurm_binaries()), reason="Slurm is not installed")
@pytest.mark.parametrize("script", ["slurm/train.sh", "slurm/train_srun.sh"])
def test_scancel_stops_with_a_checkpoint_and_no_requeue(one_node, tmp_path, script):
    run_dir = tmp_path / "run"
    env = {"PYTHON": sys.executable, "PYTHONPATH": str(REPO), "GLOO_SOCKET_IFNAME": "lo", "RANKS_PER_NODE": "2"}
    options = ("--ntasks-per-node=2",) if script.endswith("srun.sh") else ()
    job_id = one_node.submit(REPO / script, "configs/ci_tiny.yaml", f"run.dir={run_dir}", *LONG_RUN,
                             sbatch_options=options, env=env, cwd=REPO)  # fmt: skip
    alive = lambda: bool(one_node.run("squeue", "-h", "-j", job_id).stdout.strip())  # noqa: E731
    wait_for(run_dir / "checkpoints" / "latest", alive, "first checkpoint")
    cancelled = time.monotonic()
    done = one_node.run("scancel", job_id)  # what a person types: SIGTERM to the steps, SIGKILL KillWait s later
    assert done.returncode == 0, done.stderr
    job = one_node.wait_job(job_id, JOB_TIMEOUT_S)
    took = time.monotonic() - cancelled
    fields = one_node.job_fields(job_id)
    logs = job.output + "".join(p.read_text(errors="replace") for p in (run_dir / "logs").rglob("*") if p.is_file())
    stops = sorted({line.split("spmd_rl: ", 1)[-1] for line in logs.splitlines() if "stopped by" in line})
    print(f"\nsbatch {script} + scancel: {job.state} {job.exit_code} after {took:.1f} s, restarts "
          f"{fields.get('Restarts')}; {stops}; run.lock exit_code {exit_recorded(run_dir)}")  # fmt: skip
    assert job.state == "CANCELLED" and fields.get("Restarts") == "0", job.output[-3000:]
    assert len(stops) == 1 and "stopped by SIGTERM" in stops[0], logs[-3000:]
    assert exit_recorded(run_dir) == 75
