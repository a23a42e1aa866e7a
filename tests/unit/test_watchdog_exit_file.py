"""A call that overruns its bound on rank 0 leaves the exit code 4 in $SPMD_RL_EXIT_FILE, as every other way rank 0
ends does: launch/*.sh read the job's code from there, and without it a hang in rank 0's check before start
(importing a plug-in, before the process group) read as a rank that ended before it could say why, exit 3, beside
the watchdog's own line (fault pass 6, U2). Another rank's overrun leaves the file alone (rank 0's to write)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from harness.runs import ROOT

from spmd_rl.runtime.postmortem import job_exit_code

HANGS = (
    "import time\n"
    "from spmd_rl.runtime.watchdog import watchdog\n"
    "watchdog.configure(0.5, 'rank 0')\n"
    "with watchdog.watch('importing module fpplug (algo.class)'):\n"
    "    time.sleep(60)\n"
)


@pytest.mark.parametrize("rank, left", [("0", "4"), ("1", "")])
def test_an_overrun_on_rank_0_leaves_code_4_for_the_launch_scripts(tmp_path, rank, left):
    # rank 1 leaves its failure record instead, which the scripts read too (fault pass 6, U3b: a plug-in's import
    # hanging on rank 1 ended in exit 3, "a rank ended before it could say why")
    exit_file, records = tmp_path / "exit", tmp_path / "failures"
    exit_file.write_text("")
    records.mkdir(mode=0o700)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SPMD_RL_EXIT_FILE": str(exit_file), "RANK": rank}
    env["SPMD_RL_FAILURE_DIR"] = str(records)
    result = subprocess.run([sys.executable, "-c", HANGS], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 4, result.stderr
    assert "did not return within 0.5 s" in result.stderr
    assert exit_file.read_text().strip() == left
    assert job_exit_code(records) == (None if rank == "0" else 4)


EXITS = (
    "from spmd_rl.runtime.user_exits import guard_os_exit\n"
    "import os\n"
    "guard_os_exit()\n"
    "def user_code():\n"
    "    os._exit(5)\n"
    "user_code()\n"
)


@pytest.mark.parametrize("rank, left", [("0", "4"), ("1", "")])
def test_os_exit_in_user_code_on_rank_0_leaves_code_4_too(tmp_path, rank, left):
    """os._exit in a plug-in on rank 0 ends with its line and exit 4; launch/mpirun.sh kept mpirun's two boxes
    (9 lines) as if rank 0 had left no code (fault pass 6, P1b: os._exit in the algorithm's constructor)."""
    exit_file = tmp_path / "exit"
    exit_file.write_text("")
    script = tmp_path / "plugin.py"  # user code: a file of the user's, not the framework's
    script.write_text(EXITS)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SPMD_RL_EXIT_FILE": str(exit_file), "RANK": rank}
    result = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 4, result.stderr
    assert "os._exit(5) was called" in result.stderr
    assert exit_file.read_text().strip() == left
