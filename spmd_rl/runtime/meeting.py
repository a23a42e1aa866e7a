"""The ranks meet in the job's store before the process group forms, so that a rank whose check before start failed
is heard at once instead of being waited for until dist.timeout_s.

Rank 0 opens the job's store before its own checks. Every other rank, once its checks passed, says it arrived;
one whose checks failed leaves its exit code and its line instead (`tell_rank_0`). Rank 0, its own checks passed,
waits in `meet` until every rank arrived (then the process group forms, as before) or one failed: rank 0 prints that
rank's line (unless the rank printed it itself: it was the first rank of its host, or user code called sys.exit),
marks the start abandoned, and ends with that rank's code; the ranks waiting for the group see the mark and end
quietly with the same code. Rank 0's line comes before its mark, so a launcher that stops the job when the failed
rank exits (it waits for the mark, up to a bound) cannot cut that line off. When rank 0 fails its own checks it
speaks for the job as before and never reads the others' records.

No job key exists before the group (it is broadcast over it: spmd_rl.runtime.postmortem), so these records are not
signed: a local process that can reach the store could end a start with a line of its own making, as it could
already stop the rendezvous itself. The line is shown as a rank's line, never blamed on another rank by rank 0.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from spmd_rl.runtime.errors import USER_ERROR_EXIT_CODE, CommError, UserError
from spmd_rl.runtime.exits import QUIET_RANK_LINGER_S, user_error, user_error_line
from spmd_rl.runtime.job_store import open_rendezvous
from spmd_rl.runtime.launch import LaunchInfo
from spmd_rl.runtime.signals import signals_held_off
from spmd_rl.runtime.user_exits import say_user_exit

ARRIVED = "spmd_rl/meeting/arrived/rank{}"
FAILED = "spmd_rl/meeting/failed/rank{}"
OUTCOME = "spmd_rl/meeting/outcome"  # "go", or "abandoned <exit code>"
POLL_S = 0.02


class StartAbandoned(Exception):
    """A rank failed its check before start; the job ends with its exit code. Its line has been printed (by it or
    by rank 0 for it): the other ranks end quietly."""

    def __init__(self, exit_code: int):
        super().__init__(f"the start was abandoned (exit code {exit_code})")
        self.exit_code = exit_code


def meet(store, rank: int, world_size: int, timeout: datetime.timedelta) -> None:
    """Before init_process_group, on every rank of a distributed run: returns once every rank arrived; raises
    StartAbandoned when one failed before it (rank 0 prints its line first), CommError when dist.timeout_s passed."""
    if rank != 0:
        store.set(ARRIVED.format(rank), "1")
        outcome = _wait_for_outcome(store, timeout.total_seconds())
        if outcome is None:
            raise CommError(
                f"rank {rank}: rank 0 did not open the process group within dist.timeout_s="
                f"{timeout.total_seconds():g} (it is still checking, stopped or hung, or another rank never arrived)",
                peers=(0,),
                timed_out=True,
            )
        if outcome.startswith("abandoned"):
            raise StartAbandoned(int(outcome.split()[1]))
        return
    deadline = time.monotonic() + timeout.total_seconds()
    missing = set(range(1, world_size))
    while missing:
        for other in sorted(missing):
            if store.check([FAILED.format(other)]):
                _abandon(store, json.loads(store.get(FAILED.format(other)).decode()))
            if store.check([ARRIVED.format(other)]):
                missing.discard(other)
        if missing and time.monotonic() > deadline:
            raise CommError(
                f"rank 0: ranks {sorted(missing)} did not join within dist.timeout_s={timeout.total_seconds():g} "
                f"(still starting, stopped, hung or killed before they could say why)",
                peers=tuple(sorted(missing)),
                timed_out=True,
            )
        if missing:
            time.sleep(POLL_S)
    store.set(OUTCOME, "go")


def _abandon(store, record: dict) -> None:
    exit_code, line, spoke = int(record["exit_code"]), str(record["line"]), bool(record["spoke"])
    if not spoke:
        print(line, file=sys.stderr, flush=True)
    store.set(OUTCOME, f"abandoned {exit_code}")
    raise StartAbandoned(exit_code)


def _wait_for_outcome(store, bound_s: float) -> str | None:
    deadline = time.monotonic() + bound_s
    while not store.check([OUTCOME]):
        if time.monotonic() > deadline:
            return None
        time.sleep(POLL_S)
    return store.get(OUTCOME).decode()


def _tell(connect: Callable[[], Any], rank: int, exit_code: int, line: str, spoke: bool, bound_s: float) -> bool:
    """On a rank != 0 whose check before start failed: leave its exit code and line (printed already when spoke)
    in the job's store, reached through connect(), and wait until rank 0 has heard it. Whether it did; False when
    the store cannot be reached or rank 0 ends first (it failed its own check, and spoke for the job). Bounded by
    bound_s in all; never raises."""
    heard = threading.Event()

    def tell() -> None:
        store = connect()
        record = {"exit_code": exit_code, "line": line, "spoke": spoke}
        store.set(FAILED.format(rank), json.dumps(record))
        if _wait_for_outcome(store, bound_s) is not None:
            heard.set()

    def quietly() -> None:
        try:
            tell()
        except Exception:  # noqa: BLE001 - no store (rank 0 is gone or never came): rank 0 cannot hear it
            pass

    thread = threading.Thread(target=quietly, name="spmd_rl-tell-rank-0", daemon=True)
    # torch's store client writes a warning and a C++ stack to stderr when rank 0 ends while it waits (rank 0 failed
    # its own check too and spoke for the job): nothing else of this rank is said meanwhile, so fd 2 goes nowhere.
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as nowhere:
            os.dup2(nowhere.fileno(), 2)
        with signals_held_off():  # inherited by the thread: a signal does not cut its store client's retries short
            thread.start()
        thread.join(bound_s)
    finally:
        os.dup2(saved, 2)
        os.close(saved)
    return heard.is_set()


def tell_rank_0(launch: LaunchInfo, exit_code: int, line: str, spoke: bool, timeout_s: float) -> bool:
    """On a rank != 0 of a distributed run whose checks before start failed: its exit code and line reach rank 0,
    which prints the line (unless spoke) and ends the job with that code. Whether rank 0 heard it; never raises."""
    if not launch.distributed or launch.rank == 0:
        return False
    # rank 0 opened the store before its own checks: a store that is not there this long after is not coming
    connect_timeout = datetime.timedelta(seconds=min(timeout_s, QUIET_RANK_LINGER_S))

    def connect() -> Any:
        return open_rendezvous(launch, connect_timeout)["store"]

    return _tell(connect, launch.rank, exit_code, line, spoke, timeout_s)


def refuse_start(launch: LaunchInfo, error: UserError, speaker: bool, rank: int | None, timeout_s: float) -> int:
    """A check before start refused (error): its line by the speaker, and exit code 2. rank: None when the error
    is the same on every rank (the config, the layout: rank 0 speaks), else this rank's own (its host's env and
    files, the policy built here), which rank 0 hears at once (tell_rank_0) instead of waiting for this rank."""
    if rank is None or launch.rank == 0:
        return user_error(error, speaker=speaker, rank=rank)
    if speaker:
        user_error(error, speaker=True, rank=rank)
    began = time.monotonic()
    if tell_rank_0(launch, USER_ERROR_EXIT_CODE, user_error_line(error, rank), speaker, timeout_s) or speaker:
        return USER_ERROR_EXIT_CODE
    # rank 0 failed too and spoke for the job: this rank ends quietly, lingering no longer than it always did
    return user_error(error, speaker=False, linger_s=QUIET_RANK_LINGER_S - (time.monotonic() - began))


def exit_before_start(launch: LaunchInfo, exc: SystemExit, timeout_s: float) -> int:
    """sys.exit() in user code during the checks before start: this rank's line and exit code 4, heard by rank 0."""
    code = say_user_exit(exc, f"rank {launch.rank}")
    tell_rank_0(launch, code, "", spoke=True, timeout_s=timeout_s)
    return code
