"""launch/torchrun.sh and launch/mpirun.sh refuse a rank count that is none (NPROC=0, NPROC=abc, NP=abc) in one line
and exit 2, before they start anything: it ended in torchrun's AssertionError / ValueError traceback (mpirun's usage
box), then the script's "a rank ended before it could say why (killed, or dead before Python ran)", exit 3 (fault
pass 8, LS1, LS2)."""

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
