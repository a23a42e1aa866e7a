"""Every rank makes its torchrun attempt's record directory (attempt<N> under $SPMD_RL_FAILURE_DIR) as it starts:
launch/*.sh summarize the last attempt's records, and a restarted attempt that ended cleanly left none, so the
script printed the failed attempt's 'job summary: rank 1 ... stopped responding first' after the restarted
attempt's stop line (fault pass 6, MR: MAX_RESTARTS=1, rank 1 killed, the restart stopped with a checkpoint)."""

from __future__ import annotations

import os
import subprocess
import sys

from harness.runs import ROOT


def _start(tmp_path, **env):
    """`python -m spmd_rl.main --help`-like start: main's start-up up to the config (a bad key ends it there)."""
    line = [sys.executable, "-m", "spmd_rl.main", "no.such.key=1"]
    full = {**os.environ, "PYTHONPATH": str(ROOT), "SPMD_RL_FAILURE_DIR": str(tmp_path), **env}
    return subprocess.run(line, env=full, capture_output=True, text=True, timeout=120)


def test_a_restarted_attempt_makes_its_directory_before_anything_can_fail(tmp_path):
    result = _start(tmp_path, TORCHELASTIC_RESTART_COUNT="1", RANK="1")
    assert result.returncode == 2, result.stderr
    assert (tmp_path / "attempt1").is_dir()


def test_outside_torchrun_nothing_is_made(tmp_path):
    _start(tmp_path)
    assert list(tmp_path.iterdir()) == []
