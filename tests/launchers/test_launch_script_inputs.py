"""launch/torchrun.sh and launch/mpirun.sh refuse a rank count that is none (NPROC=0, NPROC=abc, NP=abc) in one line
and exit 2, before they start anything: it ended in torchrun's AssertionError / ValueError traceback (mpirun's usage
box), then the script's "a rank ended before it could say why (killed, or dead before Python ran)", exit 3 (fault
pass 8, LS1, LS2)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from harness.launch import job_env

ROOT = Path(__file__).resolve().parents[2]


def _script(script: str = "torchrun.sh", **variables: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", f"launch/{script}", "--config", "configs/ci_tiny.yaml", "--dry-run"],
        cwd=ROOT,
        env=job_env(**variables),
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("nproc", ["0", "abc", "-2"])
def test_a_rank_count_that_is_none_is_one_line(nproc):
    result = _script(NPROC=nproc, PYTHON=sys.executable)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == (
        f"spmd_rl: torchrun.sh: NPROC={nproc}: give the number of ranks on this node (1 or more)"
    )


@pytest.mark.parametrize("np", ["abc", "-2"])
def test_mpirun_sh_a_rank_count_that_is_none_is_one_line(np):
    """The same under launch/mpirun.sh: mpirun's usage box, then "a rank ended before it could say why", exit 3
    (fault pass 8, LS2; NP=0 stays Open MPI's "as many as the slots")."""
    result = _script("mpirun.sh", NP=np, PYTHON=sys.executable)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == f"spmd_rl: mpirun.sh: NP={np}: give the number of ranks (1 or more)"


@pytest.mark.parametrize("script, variable", [("torchrun.sh", "NPROC"), ("mpirun.sh", "NP")])
def test_a_rank_count_this_hosts_memory_cannot_hold_is_one_line(script, variable, tmp_path):
    """NPROC=99999 (a typo) started ranks until the OOM killer ended processes of other users (fault pass 9, LS1).
    PYTHON=/bin/false and an mpirun on PATH that exits at once: should the check ever go, nothing starts here."""
    (tmp_path / "mpirun").write_text("#!/bin/sh\nexit 99\n")
    (tmp_path / "mpirun").chmod(0o755)
    path = f"{tmp_path}:{os.environ['PATH']}"
    result = _script(script, **{variable: "99999"}, PYTHON="/bin/false", PATH=path)
    assert result.returncode == 2, result.stderr
    line = result.stderr.strip()
    assert line.startswith(f"spmd_rl: {script}: {variable}=99999: more ranks than this host's memory holds ("), line
    assert "\n" not in line and f"lower {variable}" in line, line
