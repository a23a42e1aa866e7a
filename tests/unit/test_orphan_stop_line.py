"""A rank whose torchrun agent is gone stops as on a SIGTERM and says so in the stop's one line, never in a second
line beside it: when the agent relayed a signal before it went (a SIGTERM to the launcher's group), the rank stops
for that signal and its line is the usual one (CI saw two lines here once, 2026-12-06)."""

import subprocess
import sys
import textwrap

import pytest

_CHILD = textwrap.dedent(
    """
    import os, signal
    from spmd_rl.runtime.errors import StopSignal
    from spmd_rl.runtime.signals import install_early_signal_handlers, raise_early_signal, signal_self, stop_cause
    install_early_signal_handlers()
    if {relayed}:
        os.kill(os.getpid(), signal.SIGTERM)  # the agent passed the group's SIGTERM on, then went
    signal_self(signal.SIGTERM, "the torchrun agent, pid 7, is gone; killed?")
    signal_self(signal.SIGTERM, "a second cause")  # a stop already asked for goes on as it is
    try:
        raise_early_signal()
    except StopSignal as stop:
        print(stop.signal_name + stop_cause())
    """
)


@pytest.mark.parametrize(
    "relayed, line",
    [(False, "SIGTERM (the torchrun agent, pid 7, is gone; killed?)"), (True, "SIGTERM")],
)
def test_the_agents_going_is_named_in_the_stops_one_line(relayed, line):
    child = subprocess.run(
        [sys.executable, "-c", _CHILD.format(relayed=relayed)], capture_output=True, text=True, timeout=60
    )
    assert child.returncode == 0, child.stderr
    assert child.stdout.splitlines() == [line], child.stdout + child.stderr


@pytest.mark.parametrize(
    "agent, said", [(4242, "the torchrun agent, pid 4242, is gone"), (-1, "the torchrun agent is gone")]
)
def test_an_agent_gone_before_the_watch_began_has_no_pid_in_the_line(agent, said):
    # -1: the rank's parent was already init when its watch began (fault pass 5, V4: "pid -1" in the line)
    from spmd_rl.runtime.orphans import agent_gone

    line = agent_gone(agent)
    assert line.startswith(said) and "-1" not in line, line


@pytest.mark.parametrize("gone", [True, False])
def test_a_stop_agreed_before_this_ranks_watch_saw_the_agent_go_still_names_it(monkeypatch, gone):
    # fault pass 7, K1: kill -9 of plain torchrun's agent while training; another rank's watch saw it first, the
    # stop reached rank 0 through the iteration's agreement, and rank 0's line said "stopped by SIGTERM ...; plain
    # torchrun reports the stop as a failure below and exits 1", with no agent left to report anything
    import os
    from pathlib import Path

    from spmd_rl.persist.run_control import StoppedWithCheckpoint
    from spmd_rl.runtime import orphans
    from spmd_rl.runtime.exits import AGENT_VARIABLE, EXIT_FILE_VARIABLE

    monkeypatch.setenv(AGENT_VARIABLE, "job")
    monkeypatch.delenv(EXIT_FILE_VARIABLE, raising=False)
    agent = os.getppid() + 1 if gone else os.getppid()
    monkeypatch.setattr(orphans._Watched, "agent", agent)
    line = str(StoppedWithCheckpoint("SIGTERM", 18, Path("/r/checkpoints/iter_000000018")))
    if gone:
        assert line.startswith(f"stopped by SIGTERM (the torchrun agent, pid {agent}, is gone; killed?) after"), line
        assert "reports the stop as a failure" not in line, line
    else:
        assert line.startswith("stopped by SIGTERM after iteration 18") and "reports the stop as a failure" in line
