"""launch/common.sh passes a signal on to the launcher once per request: a repeat of the same signal within 2 s is
the same request arriving again (`timeout` sends its SIGTERM to the script and then to its whole process group),
as the ranks take it. Passed on twice, a torchrun agent that got the second SIGTERM while it logged the first
printed a 20-line "--- Logging error ---" block before the stop line (fault pass 5, K0 and J2: `timeout 180
launch/torchrun.sh ...`, SIGTERM to the group). A second signal after the window is passed on (it stops at once)."""

import signal
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# A stand-in for the launcher: counts the SIGTERMs it gets, then ends 0.
JOB = 'trap "echo TERM >> $COUNT" TERM; for _ in $(seq 50); do sleep 0.1; done'
SCRIPT = f"source \"{REPO}/launch/common.sh\"; make_exit_file; bash -c '{JOB}' & wait_for_launcher $!"


@pytest.mark.parametrize("gap_s, relayed", [(0.3, 1), (2.5, 2)])
def test_a_repeated_signal_is_passed_on_once(tmp_path, gap_s, relayed):
    count = tmp_path / "count"
    script = subprocess.Popen(["bash", "-c", SCRIPT], env={"COUNT": str(count), "PATH": "/usr/bin:/bin"})
    time.sleep(1.0)  # its traps are set
    script.send_signal(signal.SIGTERM)
    time.sleep(gap_s)
    script.send_signal(signal.SIGTERM)
    assert script.wait(timeout=30) == 0
    assert count.read_text().split() == ["TERM"] * relayed
