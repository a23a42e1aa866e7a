"""Signals: what SIGINT, SIGTERM, SIGUSR1 and SIGHUP do to a rank. No torch here: main.py installs the early handlers
before the seconds-long imports, so a signal at any moment after launch ends in a line and a defined exit code."""

from __future__ import annotations

import errno
import io
import os
import signal
import stat
import sys
import threading
import time
from collections.abc import Callable

from spmd_rl.runtime.errors import StopSignal
from spmd_rl.runtime.exits import leave_exit_code
from spmd_rl.runtime.launch import rank_from_env
from spmd_rl.runtime.postmortem import FAILURE_DIR_VARIABLE, a_rank_has_failed
from spmd_rl.runtime.watchdog import watchdog

ANNOUNCE_AFTER_S = 1.0  # a failed rank's peers see a closed socket at once and write their records well within this

# SIGHUP: the terminal closed or the ssh session dropped; left at its default it ends the run at once, silently,
# losing the iterations since the last periodic checkpoint.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGHUP)

# launch/mpirun.sh and launch/torchrun.sh write the signal they received into this file before they pass it on; a
# SIGHUP reaches the ranks as SIGTERM (mpirun and torchrun's agent are given SIGTERM for it), and the lines name the
# signal the user sent (fault pass 6, X1).
SIGNAL_FILE_VARIABLE = "SPMD_RL_SIGNAL_FILE"


def signal_name(signum: int) -> str:
    """signum's name for a line; for a SIGTERM a launch script passed on for the SIGHUP or SIGINT it received, that
    signal (mpirun gives the ranks SIGTERM for a Ctrl-C: its lines said SIGTERM; fault pass 9, S5)."""
    name = signal.Signals(signum).name
    path = os.environ.get(SIGNAL_FILE_VARIABLE)
    if signum != signal.SIGTERM or not path:
        return name
    try:  # the script's own small file; O_NONBLOCK: were it ever a FIFO, this opens without waiting
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            received = os.read(fd, 16).strip()
        finally:
            os.close(fd)
    except OSError:
        return name
    return {b"HUP": "SIGHUP", b"INT": "SIGINT"}.get(received, name)


# A stop signal within this many seconds of the first is the same request, not "stop at once": a signal to the
# whole process group (a terminal's Ctrl-C, scancel, timeout) reaches a rank directly and again through its
# launcher (torchrun's agent relays SIGTERM after the terminal's SIGINT, mpirun relays what it got); no person
# asks twice that fast. A second signal after the window still stops at once.
REPEAT_WINDOW_S = 2.0


def _handled_signals() -> tuple[signal.Signals, ...]:
    """STOP_SIGNALS, but SIGINT and SIGHUP only where they are not ignored: a process started with SIGINT ignored (a
    background job, `cmd &`, of a script) was meant by its shell to outlive the terminal's Ctrl-C, one started with
    SIGHUP ignored (`nohup`) to outlive the terminal, and each keeps ignoring it."""
    return tuple(
        signum
        for signum in STOP_SIGNALS
        if signum not in (signal.SIGINT, signal.SIGHUP) or signal.getsignal(signum) is not signal.SIG_IGN
    )


def sigint_ignored() -> bool:
    return signal.getsignal(signal.SIGINT) is signal.SIG_IGN


SIGINT_IGNORED_NOTE = (
    "spmd_rl: note: this run was started with SIGINT ignored (a background job of a script, `cmd &`): Ctrl-C will "
    "not reach it; stop it with SIGTERM (kill -TERM {pid}), which saves a checkpoint"
)


def _leave_hung_up_terminal() -> None:
    """Point stdout and stderr at /dev/null where they are a terminal that hung up, as nohup would have: every write
    to it fails (EIO), and the stop's first line would end the run with an OSError instead of its checkpoint. Its
    SIGHUP is the usual signal, but a rank whose launcher got it hears SIGTERM from the launcher. A hung-up terminal
    is a character device that is no longer a tty to isatty (its ioctls fail too); a live terminal is kept. What the
    run says is then in its files (run.lock, metrics.jsonl)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            fd = stream.fileno() if stream is not None else -1
            if fd >= 0 and stat.S_ISCHR(os.fstat(fd).st_mode) and not os.isatty(fd):
                _point_at_devnull(fd)
        except (OSError, ValueError):  # a stream without a file descriptor (a test's capture): nothing to detach
            pass


def _point_at_devnull(fd: int) -> None:
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


class _TerminalFile(io.FileIO):
    """A terminal's file descriptor whose write, once the terminal hung up (EIO), points it at /dev/null and drops
    the text: no one reads a terminal that went away, and a line printed between the hangup and the SIGHUP
    handler (or with no SIGHUP to this rank at all: its launcher's terminal hung up) no longer ends the run with an
    OSError, exit 1, instead of its stop and checkpoint."""

    def write(self, data) -> int:
        try:
            return super().write(data)
        except OSError as exc:
            if exc.errno != errno.EIO:
                raise
            _point_at_devnull(self.fileno())
            return memoryview(data).nbytes


def outlive_terminal_hangup() -> None:
    """sys.stdout and sys.stderr, where they are a terminal, write through _TerminalFile (the same descriptor, the
    same encoding and buffering): output to a terminal that hung up is dropped instead of failing. Called at start,
    before anything keeps a reference to the streams (a logging handler)."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        try:
            if not isinstance(stream, io.TextIOWrapper) or not os.isatty(stream.fileno()):
                continue
            stream.flush()
        except (OSError, ValueError):  # no descriptor, or the terminal is gone already: nothing to keep writing to
            continue
        text = io.TextIOWrapper(
            io.BufferedWriter(_TerminalFile(stream.fileno(), "w", closefd=False)),
            encoding=stream.encoding,
            errors=stream.errors,
            line_buffering=stream.line_buffering,
            write_through=stream.write_through,
        )
        setattr(sys, name, text)


def _is_repeat(first_at: float | None) -> bool:
    return first_at is not None and time.monotonic() - first_at < REPEAT_WINDOW_S


class _Cause:
    text = ""  # why this process signalled itself, for the stop's one line: " (the torchrun agent ... is gone)"


def signal_self(signum: int, cause: str) -> None:
    """Stop this process as if signum came from outside, naming cause in the stop's one line (instead of a second
    line beside it). A stop already asked for goes on as it is: a second signal would make it a stop at once."""
    if _Early.requested is not None or _Graceful.requested is not None:
        return
    _Cause.text = f" ({cause})"
    os.kill(os.getpid(), signum)


def stop_cause() -> str:
    """ " (why)" after a signal's name in a stop line, when this process sent the signal itself; "" otherwise."""
    return _Cause.text


class _Early:
    requested: tuple[str, int] | None = None
    requested_at: float | None = None  # time.monotonic() of the first signal
    on_quiet_stop: Callable[[int, str], None] | None = None  # (exit code, line) of a rank other than 0 that ends


def install_early_signal_handlers(on_quiet_stop: Callable[[int, str], None] | None = None) -> None:
    """Until install_signal_handlers: a first signal is remembered, and raised there; a second one ends the
    process at once with its line. Raising in the middle of an import would leave torch or numpy half-loaded (an
    ImportError, or an abort, later), so the first one waits for that safe point. on_quiet_stop(code, line): what a
    rank other than 0, which prints nothing, does before it ends so (main.py: rank 0 hears it)."""
    _Early.on_quiet_stop = on_quiet_stop
    for signum in _handled_signals():
        signal.signal(signum, _on_early_signal)


def _on_early_signal(signum: int, frame) -> None:
    name = signal.Signals(signum).name
    _leave_hung_up_terminal()
    # Inside user code (a plug-in module's import) the safe point may never come: the first signal ends it.
    in_user_code = watchdog.watching()
    if _Early.requested is None and not in_user_code:
        _Early.requested, _Early.requested_at = (name, signum), time.monotonic()
        return
    if _Early.requested is not None and _is_repeat(_Early.requested_at):  # the same request, again via the launcher
        return
    code = 130 if signum == signal.SIGINT else 128 + signum
    rank = rank_from_env()
    during = f" ({in_user_code})" if in_user_code else ""
    if rank in (None, 0):  # rank 0 speaks for the job (see main.py); the rest end quietly
        line = f"spmd_rl: stopped by {name}{stop_cause()} while starting{during}, before the run began"
        print(line, file=sys.stderr, flush=True)
        leave_exit_code(code)
    elif _Early.on_quiet_stop is not None:
        _Early.on_quiet_stop(
            code, f"spmd_rl: rank {rank}: stopped by {name} while starting{during}, before the run began"
        )
    os._exit(code)


def raise_early_signal() -> None:
    """A safe point during start-up (before a user module's import, which may never return): a signal the early
    handlers remembered is raised now (StopSignal or KeyboardInterrupt); nothing happens without one."""
    if _Early.requested is not None:
        name, signum = _Early.requested
        _Early.requested = None
        raise KeyboardInterrupt() if signum == signal.SIGINT else StopSignal(name, signum)


def install_signal_handlers() -> None:
    """SIGINT, SIGTERM, SIGUSR1 and SIGHUP, in the main thread; a signal the early handlers remembered is raised now.

    While the engine's loop runs (`stop_at_iteration_boundary(True)`), the first signal only asks for a stop: the
    ranks finish the iteration, agree, save a checkpoint and exit (run_control.RunControl). Otherwise, and for a
    second signal, SIGTERM/SIGUSR1/SIGHUP raise StopSignal and SIGINT KeyboardInterrupt, so every finally-block (and the
    flush of open files) still runs: without a handler SIGTERM ends the process at once. The exception is held
    back while a file commit is in progress (see signals_deferred). Python runs handlers between bytecodes, so a
    rank blocked inside a C++ wait sees the signal when that wait returns (at most dist.timeout_s later).
    """
    for signum in _handled_signals():
        signal.signal(signum, _on_signal)
    if _Early.requested is not None:
        name, early_signum = _Early.requested
        _Early.requested = None
        raise KeyboardInterrupt() if early_signum == signal.SIGINT else StopSignal(name, early_signum)


class _Graceful:
    enabled = False
    requested: tuple[str, int] | None = None
    requested_at: float | None = None  # time.monotonic() of the signal that asked for the stop
    # The last iteration's boundary has been reached (past_the_last_boundary): no boundary is left to stop at, and a
    # stop asked for from then on lets the run finish; `too_late` records which side of that moment the signal
    # came on, so that its line and what the run does agree.
    finishing = False
    too_late = False
    announcement: threading.Timer | None = None  # a stop's line, due ANNOUNCE_AFTER_S after its signal


def stop_at_iteration_boundary(enabled: bool) -> None:
    """Whether a first signal asks for a stop at the next iteration boundary (True) or raises at once (False).
    Enabling forgets a stop an earlier run in this process was asked for (spmd_rl.train runs several); disabling
    drops a stop line still due (no thread prints while the process exits)."""
    _Graceful.enabled = enabled
    if enabled:
        _Graceful.requested = None
        _Graceful.finishing = _Graceful.too_late = False
    elif _Graceful.announcement is not None:
        _Graceful.announcement.cancel()
        _Graceful.announcement = None


def requested_stop() -> tuple[str, int] | None:
    """(signal name, number) of a stop this process was asked for and has not acted on, or None; None also for one
    asked for after the last iteration's boundary (the run finishes: past_the_last_boundary)."""
    return None if _Graceful.too_late else _Graceful.requested


def past_the_last_boundary() -> None:
    """At the last iteration's boundary, before it reads requested_stop: a stop asked for before this still stops
    the run there, with its checkpoint (exit 75); one asked for from now on finds no boundary left to stop at, so
    the run finishes (exit 0), and the signal's line says that instead of promising a stop. The signal handler
    runs whole between two bytecodes of the main thread, so each signal falls on one side of this moment."""
    _Graceful.finishing = True


class _Deferral:
    depth = 0
    pending: BaseException | None = None


def _on_signal(signum: int, frame) -> None:
    name = signal.Signals(signum).name
    _leave_hung_up_terminal()
    if _Graceful.enabled and _Graceful.requested is None:
        _Graceful.requested = request = (name, signum)
        _Graceful.requested_at = time.monotonic()
        _Graceful.too_late = _Graceful.finishing
        if os.environ.get(FAILURE_DIR_VARIABLE):
            # Under a launcher that keeps failure records, the signal may be the launcher ending the job because a
            # rank failed (mpirun SIGTERMs every rank the moment one dies), before any survivor has written its
            # record: look again a little later.
            _Graceful.announcement = threading.Timer(ANNOUNCE_AFTER_S, _announce_stop, request)
            _Graceful.announcement.daemon = True
            _Graceful.announcement.start()
        else:
            _announce_stop(*request)
        return
    if _Graceful.enabled and _is_repeat(_Graceful.requested_at):  # the same request, again through the launcher
        return
    stop = KeyboardInterrupt() if signum == signal.SIGINT else StopSignal(name, signum)
    if _Deferral.depth:
        _Deferral.pending = _Deferral.pending or stop
        return
    raise stop


def _announce_stop(name: str, signum: int) -> None:
    """The line acknowledging a stop request, unless the run has acted on it already or a rank has failed: then it
    is most likely the launcher ending the job, and a checkpoint needs every rank, so no line promises one. Rank 0
    alone speaks: a terminal's Ctrl-C reaches every rank of the job, and one line says it (a signal sent to another
    rank alone stops the job all the same; rank 0's stop line names it when the checkpoint is saved)."""
    if rank_from_env() not in (None, 0):
        return
    if not _Graceful.enabled or _Graceful.requested != (name, signum) or a_rank_has_failed():
        return
    what = (
        "the last iteration is done: the run finishes (exit 0, nothing to resume)"
        if _Graceful.too_late
        else "stopping after this iteration with a checkpoint"
    )
    print(
        f"spmd_rl: {signal_name(signum)}{stop_cause()}: {what} (send it again to stop at once)",
        file=sys.stderr,
        flush=True,
    )


class signals_held_off:
    """`with signals_held_off():` the stop signals are blocked in this thread (the main one) while a C++ call runs
    that sleeps between retries: torch's store client (init_process_group's rendezvous) logs a warning and a C++
    stack trace to stderr when a signal interrupts that sleep, around the rank's one line. Python runs the handler
    only when the call returns in any case; a signal that came meanwhile stays pending and is handled as the
    section ends (another thread may take it first: that changes nothing, the handler still runs here)."""

    def __enter__(self) -> None:
        self._before = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)

    def __exit__(self, exc_type, exc, traceback) -> None:
        signal.pthread_sigmask(signal.SIG_SETMASK, self._before)


class signals_deferred:
    """`with signals_deferred():` a section that a signal must not cut in half (a file write and its commit).

    A signal that arrives inside is raised when the outermost section ends; if the section ends with an error
    anyway, that error goes on and the signal is dropped (the process is unwinding already).
    """

    def __enter__(self) -> None:
        _Deferral.depth += 1

    def __exit__(self, exc_type, exc, traceback) -> None:
        _Deferral.depth -= 1
        if _Deferral.depth or _Deferral.pending is None:
            return
        pending, _Deferral.pending = _Deferral.pending, None
        if exc_type is None:
            raise pending
