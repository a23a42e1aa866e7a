"""Output to a terminal that hung up is dropped, not an OSError: a rank that prints between its terminal's hangup and
the SIGHUP handler (which points its output at /dev/null) went on to exit 1 with EIO (fault pass 2026-12-07, S3/H1's
remaining race). A pseudo-terminal whose other end is closed is such a terminal: every write to it fails with EIO."""

from __future__ import annotations

import os
import sys

import pytest

from spmd_rl.runtime.signals import outlive_terminal_hangup


@pytest.fixture
def terminal():
    """(a pseudo-terminal's other end, its own descriptor), both closed afterwards."""
    other_end, fd = os.openpty()
    yield other_end, fd
    for descriptor in (other_end, fd):
        try:
            os.close(descriptor)
        except OSError:
            pass


def test_a_line_after_the_terminal_hung_up_is_dropped_and_output_goes_to_dev_null(terminal, monkeypatch):
    other_end, fd = terminal
    # stdout is the terminal, as for a rank started there (set in the test: pytest sets its capture again after the
    # fixtures)
    monkeypatch.setattr(sys, "stdout", open(fd, "w", closefd=False))
    outlive_terminal_hangup()
    print("iter 1", flush=True)
    assert b"iter 1" in os.read(other_end, 1024)  # a live terminal still gets every line
    os.close(other_end)  # the terminal hangs up
    print("iter 2", flush=True)  # raised OSError: [Errno 5] Input/output error
    print("spmd_rl: stopped by SIGHUP after iteration 2", flush=True)
    assert os.path.samestat(os.fstat(fd), os.stat(os.devnull))


def test_streams_that_are_no_terminal_are_left_as_they_are(monkeypatch, tmp_path):
    with open(tmp_path / "log", "w") as log:
        monkeypatch.setattr(sys, "stdout", log)
        outlive_terminal_hangup()
        assert sys.stdout is log
