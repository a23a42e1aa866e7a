"""The worker processes of env.vectorization=async (gymnasium's AsyncVectorEnv, one process per env): they leave
stops to their rank, a worker that died is named as such, and a rank whose step failed ends them without waiting on
them. No torch here: a worker started by spawn imports this module to run `leave_stops_to_the_rank`."""

from __future__ import annotations

import os
import signal
import time
import warnings

import gymnasium as gym
from gymnasium.vector.async_vector_env import AsyncState

from spmd_rl.runtime.exits import DEBUG_VARIABLE
from spmd_rl.runtime.signals import STOP_SIGNALS

DEATH_SEEN_WITHIN_S = 1.0  # a worker's pipe closes as it dies; its exit status may be collectable a moment later


def leave_stops_to_the_rank(env: gym.Env, rank_pid: int) -> gym.Env:
    """A wrapper that wraps nothing, run in each worker once its env is made (a `functools.partial` with the rank's
    pid: AsyncVectorEnv also makes one env in the rank itself, to read the spaces, which keeps its handlers): the
    worker ignores stop signals from then on. A signal sent to the whole process group (a terminal's Ctrl-C, a
    launcher's or `timeout`'s SIGTERM) reaches the workers too, while their rank stops after its iteration with a
    checkpoint and needs them until then: a worker started by spawn (default handlers) died of it, and the rank's
    step with it, so the run ended without its stop checkpoint; one started by fork ran the rank's own handler and
    printed its stop line again. The rank ends its workers itself: a close, or SIGKILL (close_envs, the
    watchdog)."""
    if os.getpid() != rank_pid:
        for signum in STOP_SIGNALS:
            signal.signal(signum, signal.SIG_IGN)
    return env


def quiet_worker_reports() -> None:
    """gymnasium's AsyncVectorEnv reports a worker's error in the rank as UserWarnings (the worker's whole traceback,
    'Received the following error from Worker-0 - Shutting it down', ...) before it raises the error there, and
    then the rank's one line says what failed; SPMD_RL_DEBUG=1 keeps them."""
    if os.environ.get(DEBUG_VARIABLE, "") in ("", "0"):
        warnings.filterwarnings("ignore", category=UserWarning, module="gymnasium.vector.async_vector_env")


def _workers(envs) -> list:
    base = getattr(envs, "unwrapped", envs)
    return list(base.processes) if isinstance(base, gym.vector.AsyncVectorEnv) else []


def worker_death(envs, exc: Exception, step: int) -> str:
    """'' unless `exc` is a closed pipe of these envs' worker (a failed step) and a worker process has ended; then what
    became of it: 'lost env worker process 1234 (killed by SIGKILL) during step 21; ...'."""
    workers = _workers(envs) if isinstance(exc, (EOFError, OSError)) else []
    deadline = time.monotonic() + DEATH_SEEN_WITHIN_S
    while workers and all(worker.exitcode is None for worker in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    ended = []
    for worker in workers:
        code = worker.exitcode
        if code is not None:
            how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
            ended.append(f"env worker process {worker.pid} ({how})")
    if not ended:
        return ""
    return (
        f"lost {', '.join(ended)} during step {step}; a worker ends when it is killed (from outside, or by the "
        f"out-of-memory killer) or its env ends its process"
    )


def close_envs(envs, abandoned: bool) -> None:
    """Close the envs; `abandoned`: a step was begun and never finished (the run is ending on an error). Then an
    AsyncVectorEnv's close() would first wait for that step's answers, and wait forever where a worker died or its
    answer was already taken by the step that failed: its workers are killed instead (they ignore stop signals),
    and the envs closed without that wait."""
    base = getattr(envs, "unwrapped", envs)
    if not abandoned or not isinstance(base, gym.vector.AsyncVectorEnv):
        envs.close()
        return
    for worker in base.processes:
        if worker.is_alive():
            worker.kill()
    base._state = AsyncState.DEFAULT  # gymnasium's record of the step in flight, which close() would wait for
    envs.close(terminate=True)
