"""A sharded trainer whose capture of its state fails (a UserError before it writes anything) while its peer has
entered the sharded save (a collective of the trainers) is heard: its line, exit 2, and no trainer waits out
dist.timeout_s inside the save. The ranks agree on the capture before the sharded save: rank 0's error was held
for the vote after the save while trainer 1 waited in DCP's gather; every rank timed out, rank 0's line was never
printed and the job summary blamed trainer 1 (fault pass 6, V5: a pretrained folder changed during the run)."""

import subprocess

import pytest
from harness.runs import TINY, run_main

TIMEOUT_S = 600  # far beyond what the job takes once heard: a wait to the bound fails the test
JOB_BOUND_S = 240


def test_a_trainer_whose_capture_fails_is_heard_and_no_trainer_waits_in_the_sharded_save(tmp_path):
    args = [
        "--config", TINY, f"run.dir={tmp_path}", "train.parallel=fsdp", f"dist.timeout_s={TIMEOUT_S}",
        "algo.class=tests.harness.capture_faults:CaptureFailsOnRankZero",
    ]  # fmt: skip
    try:
        result = run_main(*args, nproc=2, timeout=JOB_BOUND_S)
    except subprocess.TimeoutExpired as hang:
        pytest.fail(f"a trainer still waiting {JOB_BOUND_S} s after rank 0's capture failed: {hang.stderr}")
    lines = [line for line in result.stderr.splitlines() if line.startswith("spmd_rl:")]
    assert result.returncode == 2, result.stderr[-3000:]
    assert any("rank 0" in line and "rank 0's own trouble" in line for line in lines), lines
    assert not any("job summary" in line or "communication error" in line for line in lines), lines
    assert not (tmp_path / "checkpoints" / "latest").exists()
