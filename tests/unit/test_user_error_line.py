"""A user error's line names the rank once: a refusal that one rank found and rank 0 prints for every rank already
begins with that rank's name, so the printer adds none (fault pass 5, H6: "rank 0: error: rank 0 (colocated 0):
the checkpoint's policy does not fit this run's: ..."); in a one-process run, none at all."""

import pytest

from spmd_rl.runtime.errors import SharedUserError, UserError
from spmd_rl.runtime.exits import line_start, user_error_line


@pytest.mark.parametrize(
    "error, rank, line",
    [
        (SharedUserError("rank 1 (trainer 1): the checkpoint's policy does not fit"), 0, "error: rank 1 (trainer 1):"),
        (SharedUserError("rank 0 (colocated 0): damaged"), 0, "spmd_rl: error: rank 0 (colocated 0): damaged"),
        (UserError("run directory r holds a run with a different config"), 2, "spmd_rl: rank 2: error: run directory"),
        (UserError("ranks disagree"), None, "spmd_rl: error: ranks disagree"),
        (UserError("rankings: no such key"), 1, "spmd_rl: rank 1: error: rankings"),
    ],
)
def test_the_rank_is_named_once(error, rank, line, monkeypatch):
    monkeypatch.setenv("RANK", str(rank or 0))
    monkeypatch.setenv("WORLD_SIZE", "3")  # a job of several ranks: the line names the rank
    said = user_error_line(error, rank)
    assert said.startswith("spmd_rl: ") and line in said and said.count("rank ") == line.count("rank "), said


@pytest.mark.parametrize("launched", [{}, {"RANK": "0", "WORLD_SIZE": "1"}], ids=["no launcher", "world size 1"])
def test_a_one_process_run_names_no_rank(launched, monkeypatch):
    # fault pass 6, L1-L4 and H1: "spmd_rl: rank 0: error: ..." and "rank 0 (colocated 0): ..." of a run that is
    # one process, where a rank's name says nothing
    for name in ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in launched.items():
        monkeypatch.setenv(name, value)
    assert user_error_line(UserError("run.lock is not a regular file"), 0) == (
        "spmd_rl: error: run.lock is not a regular file"
    )
    assert user_error_line(SharedUserError("rank 0 (colocated 0): damaged"), 0) == "spmd_rl: error: damaged"
    assert line_start("rank 0 (colocated 0)") == "spmd_rl: "
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert line_start("rank 0 (colocated 0)") == "spmd_rl: rank 0 (colocated 0): "
