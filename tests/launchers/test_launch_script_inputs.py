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


@pytest.fixture(scope="module")
def python_without_torch(tmp_path_factory) -> str:
    """A python of an environment spmd_rl is not installed in (a new venv without packages): a venv not activated."""
    folder = tmp_path_factory.mktemp("bare_venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder)], check=True, timeout=120)
    return str(folder / "bin" / "python")


@pytest.mark.parametrize("script", ["torchrun.sh", "mpirun.sh"])
def test_a_python_without_torch_is_named_with_what_to_do(script, python_without_torch):
    """torchrun.sh read it as "a rank ended before it could say why", exit 3; mpirun.sh as "the launcher was killed
    by SIGABRT ... rerun the same command to resume", 134 (fault pass 8, LS1/LS2): the check comes only after the
    job failed with no word from its ranks, so it opens no window before the scripts' traps."""
    result = _script(script, NPROC="2", NP="2", PYTHON=python_without_torch)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        f"spmd_rl: {script}: {python_without_torch} cannot import torch: activate the environment spmd_rl is "
        "installed in (source .venv/bin/activate), or set PYTHON to its interpreter (PYTHON=.venv/bin/python)"
    )
    assert "before it could say why" not in result.stderr and "killed by" not in result.stderr


def test_no_python_on_path_is_named_with_what_to_do(tmp_path):
    for folder in ("/bin", "/usr/bin"):  # the system's commands, without any python
        for command in Path(folder).iterdir():
            if not command.name.startswith("python") and not (tmp_path / command.name).exists():
                (tmp_path / command.name).symlink_to(command)
    result = _script(NPROC="2", PATH=str(tmp_path))
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("spmd_rl: torchrun.sh: there is no 'python' on PATH:")


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
