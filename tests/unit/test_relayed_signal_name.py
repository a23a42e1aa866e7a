"""The launch scripts pass a SIGHUP on as SIGTERM (mpirun and torchrun's agent are given SIGTERM for it) and write
the signal they received into $SPMD_RL_SIGNAL_FILE first: the ranks' lines name SIGHUP, the signal the user sent,
not SIGTERM (fault pass 6, X1); the exit code is 75 as before (tests/launchers/test_launcher_exits.py)."""

from __future__ import annotations

import signal

from spmd_rl.runtime.signals import SIGNAL_FILE_VARIABLE, signal_name


def test_a_sigterm_relayed_for_a_hangup_is_named_sighup(tmp_path, monkeypatch):
    received = tmp_path / "signal"
    monkeypatch.setenv(SIGNAL_FILE_VARIABLE, str(received))
    received.write_text("HUP\n")
    assert signal_name(signal.SIGTERM) == "SIGHUP"
    assert signal_name(signal.SIGUSR1) == "SIGUSR1"  # only a SIGTERM can stand for a relayed hangup
    for got in ("TERM\n", ""):  # the script passed on what it got, or got nothing
        received.write_text(got)
        assert signal_name(signal.SIGTERM) == "SIGTERM"
    # fault pass 9, S5: launch/mpirun.sh passes a Ctrl-C on to mpirun, which gives the ranks SIGTERM for it; the stop
    # line said "stopped by SIGTERM"
    received.write_text("INT\n")
    assert signal_name(signal.SIGTERM) == "SIGINT"
    received.unlink()
    assert signal_name(signal.SIGTERM) == "SIGTERM"
    monkeypatch.delenv(SIGNAL_FILE_VARIABLE)
    assert signal_name(signal.SIGTERM) == "SIGTERM"


def test_the_stop_line_names_the_relayed_hangup(tmp_path, monkeypatch):
    from spmd_rl.persist.run_control import StoppedWithCheckpoint

    (tmp_path / "signal").write_text("HUP\n")
    monkeypatch.setenv(SIGNAL_FILE_VARIABLE, str(tmp_path / "signal"))
    stop = StoppedWithCheckpoint(signal_name(signal.SIGTERM), 3, tmp_path / "iter_000000003")
    assert str(stop).startswith("stopped by SIGHUP after iteration 3; checkpoint ")
