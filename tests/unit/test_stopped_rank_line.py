"""A rank that was itself stopped (SIGSTOP) while it waited, and whose wait expired meanwhile, says so in its line
instead of only blaming the peer it waited on: woken after its peers had given up on it, rank 1 printed "rank 0 did
not respond within dist.timeout_s=10s: it is stopped or hung" (fault pass 4, B2b; ranks by hand, rank 1 stopped for
14 s). A rank that ran all along keeps the line as it was."""

import pytest

from spmd_rl.run.driver import _report_failure
from spmd_rl.runtime.errors import CommError
from spmd_rl.runtime.launch import LaunchInfo

LAUNCH = LaunchInfo("env", 1, 2, 1, 2, "env://")
WAIT = "rank 1 (colocated 1): end-of-iteration agreement failed: rank 0 did not respond within dist.timeout_s=10s"


CLOSED = "rank 1 (colocated 1): learning failed: rank 0 closed the connection: it exited first"


@pytest.mark.parametrize("frozen_s, said", [(14.2, True), (0.0, False)])
@pytest.mark.parametrize("message, timed_out", [(WAIT, True), (CLOSED, False)])  # woken by mpirun: rank 0 left
def test_a_rank_stopped_during_its_wait_says_it_was(capsys, frozen_s, said, message, timed_out):
    failed = CommError(message, peers=(0,), timed_out=timed_out)
    code, waited, spoke = _report_failure(failed, LAUNCH, "rank 1 (colocated 1)", started=True, frozen_s=frozen_s)
    line = capsys.readouterr().err
    assert code == 3 and spoke and waited is not None and waited.peers == (0,) and waited.timed_out == timed_out
    assert line.count("\n") == 1 and message.split(" failed: ")[1] in line
    assert ("this rank itself did not run for 14 s of the wait" in line) == said, line
