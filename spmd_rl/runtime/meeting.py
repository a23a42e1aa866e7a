"""The ranks meet in the job's store before the process group forms, so that a rank whose check before start failed
is heard at once instead of being waited for until dist.timeout_s.

Rank 0 opens the job's store before its own checks. Every other rank, once its checks passed, says it arrived;
one whose checks failed leaves its exit code and its line instead (`tell_rank_0`). Each says it under the next number
of a counter, so that rank 0 hears the reports in the order they came by waiting for one key after another; every
wait is one blocking wait of the store's client, none polls (a rank waiting 20 s at the meeting used 0.12-0.13 CPU
seconds polling every 20 ms, 0.001 now: benchmarks/README.md, "Meeting before start"). Rank 0, its own checks passed,
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

# Each rank's report, arrived or failed, under the next number of COUNT: rank 0 waits for report 1, 2, ... in turn,
# so it hears the reports in the order they came, each by one blocking wait (no polling).
COUNT = "spmd_rl/meeting/reports"
REPORT = "spmd_rl/meeting/report{}"
OUTCOME = "spmd_rl/meeting/outcome"  # "go", or "abandoned <exit code>"
# A wait's thread outlives its bound by this much: a rank that gave up on it has ended by then, before the store
# client's own timeout (which writes a warning to stderr) could come.
WAIT_MARGIN_S = 120.0


class StartAbandoned(Exception):
    """A rank failed its check before start; the job ends with its exit code. Its line has been printed (by it or
    by rank 0 for it): the other ranks end quietly."""

    def __init__(self, exit_code: int):
        super().__init__(f"the start was abandoned (exit code {exit_code})")
        self.exit_code = exit_code


def meet(store, rank: int, world_size: int, timeout: datetime.timedelta, margin_s: float = 0.0) -> None:
    """Before init_process_group, on every rank of a distributed run: returns once every rank arrived; raises
    StartAbandoned when one failed before it (rank 0 prints its line first), CommError when dist.timeout_s (+
    margin_s) passed. margin_s: the others' checks before start are bounded by dist.timeout_s from their own start
    (the watchdog: a plug-in constructor that hangs), which may come seconds after this rank's; with the margin
    their line, naming the hang, comes before this wait's, which could only say they did not come (fault pass 5,
    P4f)."""
    deadline = time.monotonic() + timeout.total_seconds() + margin_s
    bound = f"dist.timeout_s={timeout.total_seconds():g}" + (f" + {margin_s:g} s" if margin_s else "")
    # The waits go through a client of their own: a wait that expires stays blocked in its client until the margin
    # past it, and anything this rank asks the store meanwhile (which ranks were heard of, its failure record) would
    # queue behind it on a shared client, so that the timeout's line came WAIT_MARGIN_S late, after the client's
    # warnings.
    waiter = store.clone()
    if rank != 0:
        _report(store, {"rank": rank, "world_size": world_size})
        outcome = _wait_for(waiter, OUTCOME, deadline)
        if outcome is None:
            raise CommError(
                f"rank {rank}: rank 0 did not open the process group within {bound} (it is still checking, "
                f"stopped or hung, or another rank never arrived)",
                peers=(0,),
                timed_out=True,
            )
        if outcome.startswith("abandoned"):
            raise StartAbandoned(int(outcome.split()[1]))
        return
    missing = set(range(1, world_size))
    for number in range(1, world_size):
        report = _wait_for(waiter, REPORT.format(number), deadline)
        if report is None:
            # a rank may have taken its number and not written its report yet: name only those not heard of
            heard = [_read_report(store, later) for later in range(number, world_size)]
            missing -= {int(record["rank"]) for record in heard if record is not None}
            raise CommError(
                f"rank 0: ranks {sorted(missing)} did not join within {bound} (still starting, stopped, hung or "
                f"killed before they could say why)",
                peers=tuple(sorted(missing)),
                timed_out=True,
            )
        record = json.loads(report)
        if "exit_code" in record:
            _abandon(store, record)
        if record.get("world_size", world_size) != world_size:
            # A launch whose ranks disagree on the world size would meet in init_process_group and wait there for
            # ranks that never come, past dist.timeout_s (53 s for a bound of 8), under torch's warnings (fault
            # pass 4, V2): a bad launch, said once by rank 0.
            _abandon(store, {"exit_code": USER_ERROR_EXIT_CODE, "spoke": False, "line": (
                f"spmd_rl: error: rank {record['rank']} was started with world size {record['world_size']} and "
                f"rank 0 with {world_size}: start every rank with the same WORLD_SIZE"
            )})  # fmt: skip
        missing.discard(int(record["rank"]))
    store.set(OUTCOME, "go")


def _report(store, record: dict) -> None:
    """This rank's report (arrived: {"rank": r}; failed: with its exit code, line and whether it spoke) under the
    next number."""
    number = store.add(COUNT, 1)
    store.set(REPORT.format(number), json.dumps(record))


def _read_report(store, number: int) -> dict | None:
    key = REPORT.format(number)
    return json.loads(store.get(key)) if store.check([key]) else None


def _abandon(store, record: dict) -> None:
    exit_code, line, spoke = int(record["exit_code"]), str(record["line"]), bool(record["spoke"])
    if not spoke:
        print(line, file=sys.stderr, flush=True)
    store.set(OUTCOME, f"abandoned {exit_code}")
    raise StartAbandoned(exit_code)


def _wait_for(store, key: str, deadline: float) -> str | None:
    """key's value once another rank sets it, or None when time.monotonic() passes deadline first.

    One blocking wait of the store's client, in a thread of its own with the stop signals blocked: this thread waits
    for that one in Python, so a signal's handler runs here at once (a StopSignal leaves the wait), where a C++ wait
    would hold it back until it returned, and the client's retries are not cut short. The store client's own
    timeout is later than the deadline (WAIT_MARGIN_S): its warning on stderr never comes before the rank's line."""
    outcome: dict[str, Any] = {}

    def wait() -> None:
        try:
            bound = datetime.timedelta(seconds=max(0.0, deadline - time.monotonic()) + WAIT_MARGIN_S)
            store.wait([key], bound)
            outcome["value"] = store.get(key).decode()
        except Exception as exc:  # noqa: BLE001 - raised in the waiting thread below
            outcome["error"] = exc

    thread = threading.Thread(target=wait, name="spmd_rl-meeting-wait", daemon=True)
    with signals_held_off():  # inherited by the thread
        thread.start()
    thread.join(max(0.0, deadline - time.monotonic()))
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")


def _tell(connect: Callable[[], Any], rank: int, exit_code: int, line: str, spoke: bool, bound_s: float) -> bool:
    """On a rank != 0 whose check before start failed: leave its exit code and line (printed already when spoke)
    in the job's store, reached through connect(), and wait until rank 0 has heard it. Whether it did; False when
    the store cannot be reached or rank 0 ends first (it failed its own check, and spoke for the job). Bounded by
    bound_s in all; never raises."""
    heard = threading.Event()

    def tell() -> None:
        store = connect()
        _report(store, {"rank": rank, "exit_code": exit_code, "line": line, "spoke": spoke})
        store.wait([OUTCOME], datetime.timedelta(seconds=bound_s + WAIT_MARGIN_S))  # bounded by the join below
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
