"""A rank whose torchrun agent is gone stops, instead of training on as an orphan.

torchrun starts each rank in a session of its own, so a kill -9 of the launcher's process group (or of the agent
alone, or an OOM kill of it) does not reach the ranks: they would go on training with nobody to collect their exit
codes, holding the run directory's lock, so that rerunning the command is refused. A rank started by torchrun
therefore watches its parent (the agent) from the first line of main: a daemon thread compares os.getppid() with
the agent's pid twice a second, which works on every POSIX system (no prctl(PR_SET_PDEATHSIG), which is Linux-only
and fires when the parent's *thread* ends). Once the agent is gone, the rank acts as on a SIGTERM to it: the
checkpointed stop at the next iteration boundary (every rank sees the same agent go, within the poll interval), or
during start-up the stop before the run began. A rank still alive a bound later (a wait on a peer that went first)
exits at once. Its stdout and stderr may be pipes whose reader died with the agent's group (launch/torchrun.sh's
filter): those go to /dev/null, so a line written to them cannot turn the stop into an error.

Only under torchrun: elsewhere a parent's exit means nothing (`nohup python -m spmd_rl.main &` outlives its shell;
mpirun and srun stop their ranks themselves).
"""

from __future__ import annotations

import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable

from spmd_rl.runtime.exits import AGENT_VARIABLE
from spmd_rl.runtime.signals import signal_self

POLL_S = 0.5  # how often the parent's pid is compared: the stop begins at most this late


def watch_for_orphaning(bound_s: Callable[[], float], who: Callable[[], str]) -> bool:
    """Under torchrun, start the daemon thread that stops this rank when its agent is gone; whether it started.
    bound_s() is how long after the SIGTERM the rank may take to stop (read when the agent goes, so the config's
    dist.timeout_s counts once read); who() names the rank for its line."""
    if AGENT_VARIABLE not in os.environ:
        return False
    agent = os.getppid()
    if agent == 1 and not _is_torchrun(agent):  # already orphaned before this line ran (torchrun may be a
        agent = -1  # container's pid 1, though: then pid 1 is the agent)
    _Watched.agent = agent
    thread = threading.Thread(target=_watch, args=(agent, bound_s, who), name="spmd_rl-orphan-watch", daemon=True)
    thread.start()
    return True


def _watch(agent: int, bound_s: Callable[[], float], who: Callable[[], str]) -> None:
    while os.getppid() == agent:
        time.sleep(POLL_S)
    _silence_dead_pipes()
    bound = bound_s()
    # No line of its own: the stop's one line (rank 0's) names the cause, also when the agent relayed a signal
    # before it went (the ranks then stop for that one, and say so once).
    signal_self(signal.SIGTERM, agent_gone(agent))
    time.sleep(bound)
    _say(f"spmd_rl: {who()}: still running {bound:g} s after the torchrun agent went: exiting at once")
    os._exit(128 + signal.SIGTERM)


class _Watched:
    agent: int | None = None  # the agent's pid while this rank watches it


def gone_now() -> str:
    """ " (why)" for a stop line when the watched agent is gone by the time the line is written, "" otherwise. Every
    rank's watch polls on its own: another rank may see the agent go first and the stop, agreed at the iteration's
    end, reach rank 0 before its own watch does; its line then said "stopped by SIGTERM" with the note that plain
    torchrun reports the stop below, where no agent is left to report anything (fault pass 7, K1)."""
    agent = _Watched.agent
    if agent is None or os.getppid() == agent:
        return ""
    return f" ({agent_gone(agent)})"


def agent_gone(agent: int) -> str:
    """The stop's cause, in its one line. agent is -1 when the rank was orphaned before its watch began: the line
    said "the torchrun agent, pid -1, is gone" (fault pass 5, V4: the agent killed while the ranks started)."""
    if agent < 0:
        return "the torchrun agent is gone, before this rank started; killed?"
    return f"the torchrun agent, pid {agent}, is gone; killed?"


def _is_torchrun(pid: int) -> bool:
    """Whether process pid runs torchrun's agent (True where /proc cannot tell: the parent is trusted)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            argv = cmdline.read()
    except OSError:
        return True
    return b"torch.distributed.run" in argv or b"torchrun" in argv


def _silence_dead_pipes() -> None:
    """stdout and stderr, when they are pipes nobody reads any more (poll says POLLERR), go to /dev/null."""
    try:
        poller = select.poll()
    except AttributeError:  # no poll() on this system: leave them as they are
        return
    for fd in (1, 2):
        try:
            poller.register(fd, select.POLLOUT)
        except (OSError, ValueError):
            continue
    try:
        broken = [fd for fd, events in poller.poll(0) if events & (select.POLLERR | select.POLLHUP)]
        if broken:
            devnull = os.open(os.devnull, os.O_WRONLY)
            for fd in broken:
                os.dup2(devnull, fd)
            os.close(devnull)
    except OSError:
        pass


def _say(line: str) -> None:
    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError):  # a closed or broken stderr: nobody to tell
        pass
