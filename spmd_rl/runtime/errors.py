"""The two kinds of failure the program distinguishes.

UserError: the user can fix it (config, layout, environment id, launch variables). It is printed as one line and
the process exits with code 2, before any rank has started waiting on another.

CommError: a wait between ranks failed or expired. The message names this rank and role, the peer, the operation
and the message; the process exits non-zero so the launcher takes the rest of the job down.
"""

import os
import sys
import traceback

USER_ERROR_EXIT_CODE = 2
COMM_ERROR_EXIT_CODE = 3
# Stopped on a signal (or run.stop_after_iterations) with a checkpoint: rerun the same command to resume
# (EX_TEMPFAIL). launch/mpirun.sh and launch/torchrun.sh pass it on; spmd_rl.sweep exits with it too.
STOPPED_EXIT_CODE = 75


class UserError(Exception):
    """Bad input: printed without a traceback, exit code 2."""


class SharedUserError(UserError):
    """A user error every rank raises alike (rank 0 found it and told the others): only rank 0 prints it."""


class CommError(RuntimeError):
    """A point-to-point or collective wait that failed or timed out (see runtime.comm_error for the wording).

    peers: the ranks this rank was waiting on or talking to (all other members for a collective; empty when
    unknown); timed_out: the wait expired (rather than a connection closing). With both, rank 0's job summary can
    tell the rank everyone waited on from the ranks that waited (spmd_rl.runtime.postmortem)."""

    def __init__(self, message: str, peers: tuple[int, ...] = (), timed_out: bool = False):
        super().__init__(message)
        self.peers = tuple(peers)
        self.timed_out = timed_out


class StopSignal(BaseException):
    """SIGTERM or SIGUSR1 arrived (see runtime.install_signal_handlers): unwinds the stack so every finally-block,
    and the flush of open files on the exit path, runs. A BaseException, like KeyboardInterrupt, so that user code's
    `except Exception` does not swallow it."""

    def __init__(self, signal_name: str, signal_number: int):
        super().__init__(signal_name)
        self.signal_name = signal_name  # "SIGTERM"
        self.signal_number = signal_number  # for the shell's convention: exit code 128 + signal_number


USER_CODE_EXIT_CODE = 4


class UserCodeError(Exception):
    """The user's code (env, policy, algorithm, callback) raised, or gave data that cannot be used (NaN from an
    env): printed as one line naming where (rank, env, step, the user's file:line), exit code 4."""


def user_frame(exc: BaseException) -> str:
    """'file:line' of the innermost frame of exc's traceback that is the user's code (not spmd_rl, torch,
    gymnasium or the standard library); '' when there is none."""
    return innermost_user_frame(traceback.extract_tb(exc.__traceback__))


def innermost_user_frame(frames: traceback.StackSummary) -> str:
    """'file:line' of the innermost of these frames that is the user's code; '' when none is."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # spmd_rl/, above runtime/
    framework = (package, sys.prefix, sys.base_prefix)
    users = [
        f for f in frames if not os.path.abspath(f.filename).startswith(framework) and not f.filename.startswith("<")
    ]
    return f"{users[-1].filename}:{users[-1].lineno}" if users else ""


def describe_exception(exc: BaseException) -> str:
    """'Type: message (at file:line)': one line for an exception raised in the user's code."""
    where = user_frame(exc)
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {message}" + (f" (at {where})" if where else "")
