"""A bound on user code: an env's constructor, reset or step, a plug-in's constructor, an algorithm's `learn`.

A call that never returns (a simulator waiting on a socket, a deadlock in a user's module) would hang the rank
forever, and in a one-process run nothing else would notice. Each such call runs inside `watchdog.watch(what)`:
one daemon thread per process checks the current deadline a few times a second; when a call overruns it, the rank
prints one line naming the call and the user's file:line where the main thread is stuck, leaves its failure record
for rank 0's summary, and exits with USER_CODE_EXIT_CODE. Entering and leaving a watched call costs two attribute
writes, so env steps can be watched one by one.
"""

from __future__ import annotations

import faulthandler
import math
import multiprocessing
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable

from spmd_rl.runtime.errors import USER_CODE_EXIT_CODE, innermost_user_frame
from spmd_rl.runtime.exits import DEBUG_VARIABLE, leave_exit_code, line_start
from spmd_rl.runtime.launch import rank_from_env
from spmd_rl.runtime.postmortem import leave_own_record

POLL_S = 0.25  # how often the thread looks at the deadline: the line comes at most this late
FROZEN_S = 2.0  # a tick this late means the whole process was not running (stopped), not a busy main thread
COLLECTIVE_MARGIN_S = 60.0  # the extra bound of calls that wait on other ranks (learn): their wait speaks first


class _Continued:
    """When this process last handled a SIGCONT: a late tick counts as the process stopped only if one came after it
    began. Ticks also come late on an overloaded machine (load 10 on 2 cores starved a rank's watchdog thread for
    2 s, fault pass 8, J2), and such a rank, saying it was stopped, took the blame its peers' waits point at."""

    at = -math.inf


def _note_continued(signum: int, frame: object) -> None:
    _Continued.at = time.monotonic()


class Watchdog:
    """watch(what) bounds the calls made inside it to `timeout_s` (0 = unbounded). One per process: `watchdog`."""

    def __init__(self) -> None:
        self.timeout_s = 0.0
        self.who = "spmd_rl"
        self.on_expiry: Callable[[], None] | None = None
        # (deadline, the call, its bound in s): one tuple, replaced atomically
        self._current: tuple[float, str, float] = (math.inf, "", 0.0)
        self._thread: threading.Thread | None = None
        self._last_tick = time.monotonic()
        self._gaps: list[tuple[float, float]] = []  # (when it ended, seconds): ticks that came far too late
        self._main = threading.main_thread().ident

    def configure(self, timeout_s: float, who: str, on_expiry: Callable[[], None] | None = None) -> None:
        """Bound the watched calls of this process by timeout_s; `who` starts the line ('rank 2 (env 0)');
        on_expiry runs before the exit (it leaves the failure record) and must not block for long."""
        self.timeout_s, self.who, self.on_expiry = timeout_s, who, on_expiry
        if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGCONT) in (
            signal.SIG_DFL,
            None,
        ):
            signal.signal(signal.SIGCONT, _note_continued)
            signal.siginterrupt(signal.SIGCONT, False)  # a system call it lands in resumes, as without the handler

    def rebound(self, timeout_s: float) -> None:
        """A bound already in force takes this value (the config's dist.timeout_s, once read); an unbounded
        watchdog (the Python API's) stays unbounded."""
        if self.timeout_s > 0:
            self.timeout_s = timeout_s

    def watching(self) -> str:
        """The watched call in progress ('' when none): a signal during start-up ends such a call at once."""
        return self._current[1]

    def watch(self, what: str, margin_s: float = 0.0) -> _Watched:
        """A context manager: the calls inside it must return within timeout_s (+ margin_s: for calls that wait on
        other ranks inside, so that the bounded wait's own line comes first). Nested watches keep the outer
        deadline once the inner one ends."""
        return _Watched(self, what, margin_s)

    def _arm(self, what: str, margin_s: float) -> tuple[float, str, float]:
        previous = self._current
        if self.timeout_s > 0:
            if self._thread is None:
                # Ticks count from the thread's start: the time since this module's import is not time the process
                # was stopped (a process forked from a warm interpreter imported it long before; a run arms its
                # first bound seconds after the import). Counted, it read as a freeze that moved the deadline out
                # by as long, and a stalled step went unbounded.
                self._last_tick = time.monotonic()
                self._thread = threading.Thread(target=self._run, name="spmd_rl-watchdog", daemon=True)
                self._thread.start()
            bound_s = self.timeout_s + margin_s
            self._current = (time.monotonic() + bound_s, what, bound_s)
        return previous

    def _disarm(self, previous: tuple[float, str, float]) -> None:
        self._current = previous

    def frozen_for(self, within_s: float) -> float:
        """The longest time in the last `within_s` seconds this process did not run at all (its ticks stopped, and
        a SIGCONT came after: SIGSTOP or Ctrl-Z, then continued), including up to now; 0 when the thread was never
        started. A rank that failed after being stopped says so in its failure record, so the summary can tell it
        from its peers. A main thread that ran on while the watchdog's ticks came late (CPU starvation) is none."""
        if self._thread is None:
            return 0.0
        now = time.monotonic()
        # The stop a SIGCONT ended is the last gap that began before it was handled (the handler runs in the main
        # thread, maybe later: after the wait it was in); an earlier gap was starvation.
        stopped = [(ended, gap) for ended, gap in self._gaps if ended - gap <= _Continued.at][-1:]
        recent = [gap for ended, gap in stopped if now - ended <= within_s]
        current = now - self._last_tick - POLL_S if _Continued.at >= self._last_tick else 0.0
        return max([current, *recent, 0.0])

    def _run(self) -> None:
        while True:
            time.sleep(POLL_S)
            now = time.monotonic()
            if now - self._last_tick > FROZEN_S:
                gap = now - self._last_tick - POLL_S
                self._gaps = [*self._gaps[-7:], (now, gap)]
                current = self._current  # the time the process was stopped is not the user code's
                if self._current is current:
                    self._current = (current[0] + gap, current[1], current[2])
            self._last_tick = now
            deadline, what, bound_s = self._current
            if time.monotonic() > deadline:
                self._expire(what, bound_s)

    def _expire(self, what: str, bound_s: float) -> None:
        frame = sys._current_frames().get(self._main) if self._main is not None else None
        where = innermost_user_frame(traceback.extract_stack(frame)) if frame is not None else ""
        stuck = f"; stuck at {where}" if where else ""
        print(
            f"{line_start(self.who)}{what} did not return within {bound_s:g} s{stuck} (a hang, or slower "
            f"than the bound: raise dist.timeout_s if it is only slow; {DEBUG_VARIABLE}=1 prints every thread's "
            f"stack)",
            file=sys.stderr,
            flush=True,
        )
        if os.environ.get(DEBUG_VARIABLE):
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        if self.on_expiry is not None:
            try:
                self.on_expiry()
            except Exception:  # noqa: BLE001 - the exit below is what matters
                pass
        # Worker processes of this one (AsyncVectorEnv's envs, one of which may be the stuck call) would outlive it,
        # stuck too, and hold its stdout and stderr open: whoever reads them to the end would wait for them.
        for child in multiprocessing.active_children():
            child.kill()
        # launch/*.sh read the job's code from rank 0's exit file and the other ranks' failure records: without
        # them, a hang before the process group formed (importing a plug-in) read as a rank that ended before it
        # could say why, exit 3 (fault pass 6, U2 on rank 0, U3b on rank 1)
        rank = rank_from_env()
        if rank in (None, 0):
            leave_exit_code(USER_CODE_EXIT_CODE)
        else:
            leave_own_record(rank, USER_CODE_EXIT_CODE)
        sys.stdout.flush()
        os._exit(USER_CODE_EXIT_CODE)


class _Watched:
    __slots__ = ("dog", "what", "margin_s", "previous")

    def __init__(self, dog: Watchdog, what: str, margin_s: float):
        self.dog, self.what, self.margin_s = dog, what, margin_s

    def __enter__(self) -> None:
        self.previous = self.dog._arm(self.what, self.margin_s)

    def __exit__(self, *exc) -> None:
        self.dog._disarm(self.previous)


watchdog = Watchdog()
