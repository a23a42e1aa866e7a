"""A user error's line names the rank once: a refusal that one rank found and rank 0 prints for every rank already
begins with that rank's name, so the printer adds none (fault pass 5, H6: "rank 0: error: rank 0 (colocated 0):
the checkpoint's policy does not fit this run's: ...")."""

import pytest

from spmd_rl.runtime.errors import SharedUserError, UserError
from spmd_rl.runtime.exits import user_error_line


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
def test_the_rank_is_named_once(error, rank, line):
    said = user_error_line(error, rank)
    assert said.startswith("spmd_rl: ") and line in said and said.count("rank ") == line.count("rank "), said
