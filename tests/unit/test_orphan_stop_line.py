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
