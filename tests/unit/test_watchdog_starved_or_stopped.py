"""A rank's watchdog counts the time its process did not run (SIGSTOP) only when a SIGCONT followed: on an
overloaded machine (load 10 on 2 cores) the watchdog's ticks also came 2 s late, and ranks that had only been starved
of CPU said "this rank itself did not run for 2 s of the wait: it was stopped (SIGSTOP ...)", a claim the job
summary would blame them by (fault pass 8, J2)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

from spmd_rl.runtime.watchdog import Watchdog

# A process whose watchdog runs while its main thread first holds the GIL for ~3 s (a regex that backtracks: no
# tick can come, as under CPU starvation), then sleeps while the test stops and continues it.
CHILD = r"""
import math, re, sys, time
from spmd_rl.runtime.watchdog import Watchdog
started = time.monotonic()
re.match(r"(a+)+$", "a" * 20 + "b")  # each further "a" doubles the time: enough of them for ~3 s
length = min(30, 20 + math.ceil(math.log2(3.0 / max(time.monotonic() - started, 1e-4))))
dog = Watchdog()
dog.configure(600.0, "rank 1")
with dog.watch("a call"):
    time.sleep(0.5)
    for _ in range(3):  # one more "a" while the watchdog's ticks still came in time (a run faster than measured)
        re.match(r"(a+)+$", "a" * length + "b")
        if dog._gaps:
            break
        length += 1
    print(f"late ticks {len(dog._gaps)}; frozen {dog.frozen_for(60):.1f} s", flush=True)
    sys.stdin.readline()  # the test stops this process here, continues it, then writes a line
    time.sleep(0.6)
    print(f"frozen {dog.frozen_for(60):.1f} s", flush=True)
"""


def test_a_starved_watchdog_is_no_stop_and_a_stop_then_continue_is():
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        starved = child.stdout.readline()
        late, frozen = re.match(r"late ticks (\d+); frozen (\S+) s", starved).groups()
        assert int(late) > 0, starved  # the watchdog's thread did not run for over 2 s: starved
        assert float(frozen) == 0.0, starved  # but the process ran all along: no stop
        child.send_signal(signal.SIGSTOP)
        time.sleep(3.0)
        child.send_signal(signal.SIGCONT)
        child.stdin.write("go\n")
        child.stdin.flush()
        line = child.stdout.readline()
        stopped = float(re.match(r"frozen (\S+) s", line).group(1))
        assert 2.0 < stopped < 10.0, line
    finally:
        child.kill()
        child.wait()


def test_a_late_tick_without_a_continue_is_no_stop():
    dog = Watchdog()
    dog.configure(60.0, "rank 0")
    with dog.watch("a call"):
        time.sleep(0.6)
        dog._last_tick -= 5.0  # as if no tick had come for 5 s, and no SIGCONT: the thread was starved
        assert dog.frozen_for(60) == 0.0


def test_a_continue_names_its_own_stop_not_an_earlier_starved_gap():
    dog = Watchdog()
    dog.configure(60.0, "rank 0")
    with dog.watch("a call"):
        time.sleep(0.6)
        now = time.monotonic()
        dog._gaps = [(now - 20.0, 9.0), (now - 1.0, 3.0)]  # starved 9 s long ago; then stopped 3 s
        os.kill(os.getpid(), signal.SIGCONT)
        time.sleep(0.05)  # the handler runs at the next bytecode
        assert 2.9 < dog.frozen_for(60) < 3.5
