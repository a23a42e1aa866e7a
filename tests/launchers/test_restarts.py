"""torchrun restarts: with --max-restarts, a rank killed mid-run (kill -9) makes torchrun restart all workers, which
resume from the latest checkpoint and finish the run as if nothing happened: exit 0, finished.json, every iteration
once in metrics.jsonl. No run.dir is given, so this also tests the default run directory under torchrun
(runs/<run.name>-<config digest>: the restarted workers continue the newest unfinished run of their config).
"""

import json
import signal
import subprocess
import time

import pytest
from harness.launch import command
from harness.launch import job_env as _env
from harness.runs import TINY

SPLIT4 = ("layout.mode=split", "layout.trainer=1", "layout.inference=1", "layout.env=2")
# ci_tiny: 16 steps x 2 envs per env rank, 2 env ranks in both layouts: 64 env steps per iteration. 100 iterations
# are long enough that the kill lands mid-run, after the first checkpoint.
ITERATIONS = 100
STEPS = 64 * ITERATIONS
CHECKPOINT_EVERY = 5
RUN_TIMEOUT_S = 300  # a bound for a hang, far above the tens of seconds a run takes on a quiet machine


@pytest.mark.slow
@pytest.mark.parametrize("nproc, layout", [(2, ()), (4, SPLIT4)], ids=["colocated-2", "split-4"])
def test_a_killed_rank_is_restarted_by_torchrun_and_the_run_resumes_and_finishes(tmp_path, nproc, layout):
    cmd = [
        *command("torchrun", nproc, standalone=True, launcher_args=["--max-restarts=1"]),
        "--config",
        TINY,
        f"train.total_steps={STEPS}",
        f"checkpoint.every_iterations={CHECKPOINT_EVERY}",
        *layout,
    ]
    agent = subprocess.Popen(cmd, cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        latest = wait_for_first_checkpoint(tmp_path, agent)
        run_dir = latest.parent.parent
        workers = subprocess.run(
            ["pgrep", "-P", str(agent.pid), "-f", "spmd_rl.main"], capture_output=True, text=True
        ).stdout.split()
        assert len(workers) == nproc, workers
        victim = max(int(pid) for pid in workers)  # the last rank started: an env rank in the split layout
        subprocess.run(["kill", "-KILL", str(victim)], check=True)
        stdout, stderr = agent.communicate(timeout=RUN_TIMEOUT_S)
    finally:
        if agent.poll() is None:
            agent.send_signal(signal.SIGTERM)
            agent.wait(30)
    assert agent.returncode == 0, (stdout + stderr)[-4000:]
    assert "resuming from" in stdout, (stdout + stderr)[-4000:]
    assert (run_dir / "finished.json").is_file()
    iterations = [json.loads(line)["iteration"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert iterations == list(range(ITERATIONS))  # each once, none lost


def wait_for_first_checkpoint(cwd, agent):
    """The `latest` file of the run directory torchrun's workers chose under cwd/runs/, once it exists."""
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not (found := sorted(cwd.glob("runs/*/checkpoints/latest"))):
        if agent.poll() is not None or time.monotonic() > deadline:
            stdout, stderr = agent.communicate()
            pytest.fail(f"no checkpoint was written (exit {agent.returncode}):\n{(stdout + stderr)[-4000:]}")
        time.sleep(0.1)
    assert len(found) == 1, found
    return found[0]
