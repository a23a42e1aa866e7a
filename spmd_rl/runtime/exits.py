"""How a rank ends when something failed: one line on stderr naming the rank and the cause, and the exit code
(0 done, 2 user error, 3 communication error, 4 an error in the user's code, 1 a bug of ours, 128 + N a signal).
A user's exception shows its type, message and the user's file:line, not the framework's stack."""

from __future__ import annotations

import atexit
import io
import os
import re
import signal
import sys
import threading
import time
import traceback
from typing import NoReturn

from spmd_rl.runtime.errors import (
    STOPPED_EXIT_CODE,
    USER_CODE_EXIT_CODE,
    USER_ERROR_EXIT_CODE,
    UserError,
    describe_exception,
    user_frame,
)
from spmd_rl.runtime.launch import world_size_from_env

# Set to 1 to print full tracebacks instead of the one-line summaries of errors in user code.
DEBUG_VARIABLE = "SPMD_RL_DEBUG"

# How long a rank that leaves an error's line to the speaking rank waits before exiting. Launchers stop every rank
# as soon as one exits, so a quiet rank exiting first would stop a speaker that finds the same error a moment later
# (a busier rank) before its line is printed; the speaker's exit stops the quiet ranks instead.
QUIET_RANK_LINGER_S = 10.0


def write_whole_lines(*streams) -> None:
    """Make each line printed to these text streams reach the file in one write. Python's stderr (and stdout under
    -u or PYTHONUNBUFFERED) writes through at once, so print() is two writes, the text and then its newline, and
    ranks sharing a terminal or a launcher's pipe had their lines glued ('spmd_rl: rank 1 ...spmd_rl: rank 0
    ...' and then two newlines). Held until the newline, a line under the pipe's 4096 bytes arrives whole."""
    for stream in streams:
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(line_buffering=True, write_through=False)


def end_process(exit_code: int) -> NoReturn:
    """Exit with exit_code, doing what Python's own exit does for the program (wait for its non-daemon threads, run
    the atexit handlers: trackers, multiprocessing's children, flush stdout and stderr) but not the interpreter's
    teardown, which frees the objects of every imported module one by one: with torch, sympy and the envs loaded
    (about 2300 modules) that took 2.9 s at load 13 (fault pass 2026-12-07, W1c) and 7.5-11.8 s at load 14-25
    after the refusal line of a second copy of a running command; 0.3-0.5 s without it (benchmarks/README.md,
    "Ending a process"). Every file the run writes is closed or flushed by then (fileio.flush_open_files, run.lock's
    record), and no module's teardown does anything a run needs."""
    current = threading.current_thread()
    for thread in threading.enumerate():
        if thread is not current and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    _finalize_mpi()
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):  # a closed or hung-up terminal, a closed pipe: nothing more reaches it
            pass
    os._exit(exit_code)


def _finalize_mpi() -> None:
    """MPI_Finalize where mpi4py started MPI (launch/mpirun.sh), as the interpreter's teardown did: mpi4py finalizes
    from a C-level exit hook, not an atexit handler, so os._exit skipped it, and mpirun took every rank that ended
    without it for a crash: a finished run under launch/mpirun.sh exited 1 with mpirun's 20-line "exiting
    improperly" box (fault pass 4, E6; tests/launchers/test_mpirun.py)."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()


def quiet_torch_cpp_warnings() -> None:
    """torch's C++ log below errors off, unless TORCH_CPP_LOG_LEVEL or SPMD_RL_DEBUG=1 asks otherwise; read as torch
    loads, so called before it is imported. A rank still waiting in the job's store when a peer's store closed
    printed c10d's "recvValueWithTimeout failed" warning with a 20-frame C++ stack before its own line (fault
    pass 8, J3); the error itself still comes, as the exception the line is made of."""
    if os.environ.get(DEBUG_VARIABLE, "") in ("", "0"):
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")


def one_process() -> bool:
    """Whether this process is the whole job (no launcher, or one of world size 1): its lines name no rank, which
    would say nothing there ("rank 0 (colocated 0): ..." of a run of one process; fault pass 6, L1-L4 and H1)."""
    return world_size_from_env() in (None, 1)


def line_start(who: str) -> str:
    """'spmd_rl: rank 2 (env 0): ' that starts a rank's line in a job of several ranks; 'spmd_rl: ' in one process."""
    return "spmd_rl: " if not who or one_process() else f"spmd_rl: {who}: "


def without_own_rank(message: str) -> str:
    """message without a leading 'rank 0: ' or 'rank 0 (colocated 0): ' in one process (a refusal that names the
    rank it was found on: there is only one)."""
    return re.sub(r"^rank 0(?: \(colocated 0\))?: ", "", message) if one_process() else message


def user_error_line(exc: UserError, rank: int | None = None) -> str:
    """'spmd_rl: rank R: error: ...' (without the rank where the error is the same on every rank, where the
    message names its rank itself: a refusal one rank found and rank 0 prints for all, or in one process)."""
    where = f"rank {rank}: " if rank is not None and not re.match(r"rank \d+\b", str(exc)) else ""
    return f"{line_start(where[:-2])}error: {without_own_rank(str(exc))}"


def user_error(exc: UserError, speaker: bool, rank: int | None = None, linger_s: float = QUIET_RANK_LINGER_S) -> int:
    if speaker:
        print(user_error_line(exc, rank), file=sys.stderr, flush=True)
    else:
        # The launcher ends a lingering rank with a signal once the speaker exits: that is this rank's end as
        # planned, with its own code and nothing printed (a stop line here would be a second, false line).
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP):
            signal.signal(signum, lambda *_: os._exit(USER_ERROR_EXIT_CODE))
        time.sleep(max(0.0, linger_s))
    return USER_ERROR_EXIT_CODE


def say(who: str, kind: str, exc: Exception) -> None:
    """One line: 'spmd_rl: rank 2 (env 0): communication error: ...' (the message's own 'rank 2 ...: ' dropped)."""
    message = str(exc)
    for prefix in (f"{who}: ", f"{who.split(' (')[0]}: "):
        message = message.removeprefix(prefix)
    print(f"{line_start(who)}{kind}: {without_own_rank(message)}", file=sys.stderr, flush=True)
    if os.environ.get(DEBUG_VARIABLE, "") not in ("", "0"):
        traceback.print_exception(exc)


def unexpected_error(exc: BaseException, who: str) -> int:
    """An exception raised in the user's code (env, plug-in) is one line naming the user's file:line (exit 4);
    anything else is a bug of ours, shown with its traceback (exit 1). SPMD_RL_DEBUG=1 shows every traceback."""
    debug = os.environ.get(DEBUG_VARIABLE, "") not in ("", "0")
    if user_frame(exc) and not debug:
        print(
            f"{line_start(who)}error in user code: {describe_exception(exc)} (set {DEBUG_VARIABLE}=1 for the "
            f"traceback)",
            file=sys.stderr,
            flush=True,
        )
        return USER_CODE_EXIT_CODE
    print(f"{line_start(who)[:-2]} failed:", file=sys.stderr)  # 'spmd_rl: rank 1 (env 0) failed:' / 'spmd_rl failed:'
    traceback.print_exc()
    return USER_CODE_EXIT_CODE if user_frame(exc) else 1


EXIT_FILE_VARIABLE = "SPMD_RL_EXIT_FILE"
AGENT_VARIABLE = "TORCHELASTIC_RUN_ID"  # set by torchrun's agent for every worker it starts


def under_plain_torchrun() -> bool:
    """Whether a torchrun agent started this rank other than through launch/torchrun.sh (which reads rank 0's own
    code from $SPMD_RL_EXIT_FILE). Such an agent reports any non-zero exit as a failure, with its FAILED /
    ChildFailedError block, and exits 1."""
    return AGENT_VARIABLE in os.environ and EXIT_FILE_VARIABLE not in os.environ


def process_exit_code(exit_code: int, stopped) -> int:
    """What the process exits with: exit_code, but 0 for the stop the config asked for (stopped, the run's
    StoppedWithCheckpoint or None, is `planned`: run.stop_after_iterations) under plain torchrun, which would print
    its FAILED / ChildFailedError block for 75 and exit 1: that stop is no failure. run.lock still records 75 (a
    stopped run, to resume), and the stop line says so."""
    if exit_code == STOPPED_EXIT_CODE and getattr(stopped, "planned", False) and under_plain_torchrun():
        return 0
    return exit_code


def leave_exit_code(exit_code: int | None) -> None:
    """Rank 0's exit code, written to the file $SPMD_RL_EXIT_FILE names (launch/mpirun.sh and launch/torchrun.sh
    set it): mpirun and torchrun exit 1 when signalled, whatever the ranks did, so the scripts read the code from
    there. None empties the file: a rank 0 restarted by torchrun (MAX_RESTARTS) starts with it, so that an earlier
    attempt's code is not taken for this one's. Never raises."""
    path = os.environ.get(EXIT_FILE_VARIABLE)
    if path:
        try:
            with open(path, "w") as file:
                file.write("" if exit_code is None else f"{exit_code}\n")
        except OSError:
            pass  # the script then reports the launcher's own code
