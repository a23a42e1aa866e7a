"""The watchdog's ticks count from its thread's start, not from the module's import: a process forked from a warm
interpreter (tests/harness/rank_server.py) imported it minutes before its first bound, and that time read as a
freeze that moved the deadline out by as long (a stalled pipeline stage went unbounded past the test's 120 s in CI,
2026-12-07)."""

from __future__ import annotations

import math
import threading
import time

from spmd_rl.runtime.watchdog import Watchdog


def test_a_bound_armed_long_after_the_import_expires_on_time_and_counts_no_freeze():
    dog = Watchdog()
    dog._last_tick -= 300.0  # as if the module had been imported five minutes before the first bound
    expired = threading.Event()

    def expire(what: str, bound_s: float) -> None:  # in place of printing the line and exiting the process
        dog._current = (math.inf, "", 0.0)
        expired.set()

    dog._expire = expire  # type: ignore[method-assign]
    dog.configure(0.5, "rank 0")
    started = time.monotonic()
    with dog.watch("env.step"):
        assert expired.wait(timeout=30)
    assert time.monotonic() - started < 10  # 0.5 s and a poll or two; 300 s if the import's age counted
    assert dog.frozen_for(within_s=60) < 2  # nothing was stopped
