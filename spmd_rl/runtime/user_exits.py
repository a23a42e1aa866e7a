"""Exits from user code are never a success: `sys.exit(...)` and `os._exit(...)` called by a policy, an env, an
algorithm or a callback end the rank with exit code 4 and one line naming the user's file:line.

Without this, `sys.exit(0)` in a policy's `act` ended a run with exit 0, no line and no finished.json (it reads as
done), and `sys.exit(3)` read as a communication error. SystemExit is an exception the driver catches
(`describe_system_exit` words its line); `os._exit` ends the process at once, so `guard_os_exit` replaces it with a
function that looks at its caller: a call from user code prints the line, leaves the failure record (the
watchdog's on_expiry) and exits 4; every other caller (the framework, the standard library, torch) gets the real
os._exit unchanged. Code that calls `posix._exit` directly is not caught."""

from __future__ import annotations

import os
import sys
import traceback
from typing import NoReturn

from spmd_rl.runtime.errors import USER_CODE_EXIT_CODE, innermost_user_frame, user_frame
from spmd_rl.runtime.exits import leave_exit_code, line_start
from spmd_rl.runtime.launch import rank_from_env
from spmd_rl.runtime.watchdog import watchdog

_real_os_exit = os._exit


def say_user_exit(exc: SystemExit, who: str) -> int:
    """sys.exit() in user code (policy, env, algorithm, callback) is a failure of user code, never a success."""
    print(f"{line_start(who)}error in user code: {describe_system_exit(exc)}", file=sys.stderr, flush=True)
    return USER_CODE_EXIT_CODE


def describe_system_exit(exc: SystemExit) -> str:
    """'sys.exit(0) was called (at file:line); ...': the line for a SystemExit raised by user code."""
    where = user_frame(exc)
    at = f" (at {where})" if where else ""
    return (
        f"sys.exit({exc.code!r}) was called{at}; a run ends by finishing its iterations or by a stop, not by "
        f"exiting: raise an exception to fail, or set run.stop_after_iterations to stop early"
    )[:600]


_guarded_pid = 0  # the rank's: a process forked from it (an async env worker) exits as it asks


def guard_os_exit() -> None:
    """Route os._exit through _guarded_os_exit for the rest of this process (the command line's run only: the
    Python API leaves the interpreter as it finds it)."""
    global _guarded_pid
    _guarded_pid = os.getpid()
    os._exit = _guarded_os_exit


def _guarded_os_exit(status: int = 0) -> NoReturn:
    caller = traceback.extract_stack(sys._getframe(1), limit=1)
    where = innermost_user_frame(caller)
    if not where or os.getpid() != _guarded_pid:  # a forked env worker printed the rank's line: its rank names its end
        _real_os_exit(status)
    print(
        f"{line_start(watchdog.who)}error in user code: os._exit({status!r}) was called (at {where}); a run ends by "
        f"finishing its iterations or by a stop, not by exiting: raise an exception to fail",
        file=sys.stderr,
        flush=True,
    )
    if watchdog.on_expiry is not None:  # the rank's files whole and its failure record left, as after a hang
        try:
            watchdog.on_expiry()
        except Exception:  # noqa: BLE001 - the exit below is what matters
            pass
    if rank_from_env() in (None, 0):  # launch/*.sh read the job's code from rank 0's exit file (fault pass 6, P1b)
        leave_exit_code(USER_CODE_EXIT_CODE)
    sys.stdout.flush()
    _real_os_exit(USER_CODE_EXIT_CODE)
