"""A rank other than 0 whose check before start fails, while rank 0's passes, is heard at once: its one line
(printed by rank 0 for it, or by itself when it speaks, as for sys.exit in user code), its exit code for the job,
and rank 0 ends soon after instead of waiting out dist.timeout_s in init_process_group
(tests/harness/rank_one_faults.py). Ranks started by hand: no launcher stops rank 0 when rank 1 exits."""

import os
import signal
import subprocess
import time

import pytest
from harness.forked import ForkedJob, run_forked_job
from harness.launch import free_port, job_env, rank_env
from harness.runs import TINY

# Far beyond what the job takes once heard: a rank 0 that waits for rank 1 until the timeout fails the test.
TIMEOUT_S = 600
JOB_BOUND_S = 240


@pytest.mark.parametrize(
    "policy, code, line",
    [
        ("RaisesOnRankOne", 2, "spmd_rl: rank 1: error: policy.class 'tests.harness.rank_one_faults:RaisesOnRankOne'"),
        ("ExitsOnRankOne", 4, "spmd_rl: rank 1: error in user code: sys.exit(0) was called"),
        # os._exit ends the rank without unwinding: rank 0 waited out dist.timeout_s and blamed rank 1 for not
        # joining (fault pass 5, P3h)
        ("OsExitsOnRankOne", 4, "spmd_rl: rank 1: error in user code: os._exit(5) was called"),
    ],
)
def test_rank_1s_failed_check_is_one_line_and_ends_the_job_with_its_code(tmp_path, policy, code, line):
    args = ["--config", TINY, f"run.dir={tmp_path / 'run'}", f"dist.timeout_s={TIMEOUT_S}"]
    try:
        job = run_forked_job([*args, f"policy.class=tests.harness.rank_one_faults:{policy}"], 2, timeout=JOB_BOUND_S)
    except subprocess.TimeoutExpired as hang:
        pytest.fail(f"rank 0 still waiting {JOB_BOUND_S} s after rank 1 failed its check: {hang.stderr}")
    said = [text for text in (job.stdout + job.stderr).splitlines() if text.strip()]
    assert job.returncode == code, job.stderr
    assert len(said) == 1 and said[0].startswith(line), said  # once: rank 0 says it, or rank 1 alone
    assert "this rank's own trouble" in said[0] or code == 4, said
    assert not (tmp_path / "run").exists(), "no run directory for a start that never happened"


def test_rank_1s_hanging_check_is_named_by_its_own_line_not_as_a_rank_that_did_not_join(tmp_path):
    # rank 1's watchdog bounds its constructor by dist.timeout_s from the constructor's start, rank 0's meeting by
    # dist.timeout_s from its own: whichever came first spoke, and rank 0's could only say rank 1 did not join
    # (fault pass 5, P4f). The meeting now waits dist.timeout_s + 60 s.
    args = ["--config", TINY, f"run.dir={tmp_path / 'run'}", "dist.timeout_s=4"]
    hangs = "policy.class=tests.harness.rank_one_late_hang:HangsOnRankOne"
    job = run_forked_job([*args, hangs], 2, timeout=JOB_BOUND_S)
    said = [text for text in (job.stdout + job.stderr).splitlines() if text.strip()]
    assert job.returncode == 4, job.stderr
    assert len(said) == 1 and "did not return within 4 s; stuck at" in said[0], said
    assert "rank_one_late_hang.py" in said[0] and "did not join" not in said[0], said


def test_a_rank_whose_rank_0_never_comes_says_it_in_one_line(tmp_path):
    """Rank 1 started by hand, rank 0 never: torch's store client wrote an error, a warning and a C++ stack trace
    at each retry of its connection (41 lines) before the rank's line (fault pass 4, B6c)."""
    env = rank_env(1, 2, free_port(), OMP_NUM_THREADS="1")
    args = ["--config", TINY, f"run.dir={tmp_path / 'run'}", "dist.timeout_s=3"]
    job = ForkedJob(args, [env]).wait(JOB_BOUND_S)
    said = [text for text in (job.stdout + job.stderr).splitlines() if text.strip()]
    assert job.returncode == 3, job.stderr
    assert len(said) == 1 and said[0].startswith("spmd_rl: rank 1 (colocated 1): communication error:"), said


def test_rank_1s_hanging_plug_in_import_is_heard_by_rank_0_at_once(tmp_path):
    """The import of a plug-in named in the config hangs on rank 1: its watchdog's line, and rank 0 ends the job
    with its code at once; it waited dist.timeout_s + 60 s and said rank 1 did not join (fault pass 8, J3a)."""
    args = ["--config", TINY, f"run.dir={tmp_path / 'run'}", "dist.timeout_s=4"]
    began = time.monotonic()
    job = run_forked_job([*args, "policy.class=tests.harness.rank_one_slow_import:ActorCritic"], 2, timeout=JOB_BOUND_S)
    took = time.monotonic() - began
    said = [text for text in (job.stdout + job.stderr).splitlines() if text.strip()]
    assert job.returncode == 4, job.stderr
    assert len(said) == 1 and "importing module 'tests.harness.rank_one_slow_import'" in said[0], said
    assert "did not return within 4 s" in said[0] and took < 40, (took, said)


def test_a_stop_signal_to_rank_1_while_it_starts_is_heard_by_rank_0_at_once(tmp_path):
    """SIGTERM to rank 1 alone while it reads the config (ranks by hand: no launcher ends the others): rank 0
    prints rank 1's stop and ends the job with its code at once; it waited dist.timeout_s + 60 s and said rank 1 did
    not join (fault pass 8, H2)."""
    marker = tmp_path / "importing"
    args = ["--config", TINY, f"run.dir={tmp_path / 'run'}", f"dist.timeout_s={TIMEOUT_S}"]
    env = {**job_env(), "SPMD_RL_TEST_IMPORT_MARKER": str(marker)}
    job = ForkedJob.ranks([*args, "policy.class=tests.harness.rank_one_slow_import:ActorCritic"], 2, env=env)
    deadline = time.monotonic() + JOB_BOUND_S
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    signalled = time.monotonic()
    os.kill(job.pids[1], signal.SIGTERM)
    result = job.wait(JOB_BOUND_S)
    took = time.monotonic() - signalled
    said = [text for text in (result.stdout + result.stderr).splitlines() if text.strip()]
    assert result.returncode == 143, result.stderr
    assert len(said) == 1 and said[0].startswith("spmd_rl: rank 1: stopped by SIGTERM while starting"), said
    assert said[0].endswith("before the run began"), said
    assert took < 60 and not (tmp_path / "run").exists(), took
