"""After a failure: which rank failed first? Rank 0 says it in one summary line.

A rank whose wait on a peer fails cannot tell a dead or stopped peer from one that waits on a third rank itself,
so its own line may name an innocent peer (a knock-on). To name the cause, every failing rank leaves a record in
the job's key-value store (the store init_process_group met through): when it failed, its exit code, the ranks it
was waiting on and whether its wait expired. Rank 0, when its own failure is a communication error, waits a few
seconds for the others' records and prints one line naming the first cause:
  1. the earliest failure that is not a communication error (an env that raised, a signal, a bug): the
     communication errors of the others follow from it;
  2. else the ranks that others waited on and that left no record: killed, stopped or hung, they cannot speak;
  3. else a rank that says it did not run at all during its wait (stopped: see watchdog.frozen_for), else the
     ranks others timed out waiting on that did not time out themselves, or that failed well after every
     rank that waited on them (a rank that was stopped and resumed finds its peers gone, or its own deadline
     passed while it was stopped; a knock-on times out no earlier than the rank it waits on);
  4. else the ranks that left no record at all, or, when every rank reported, the earliest communication error.
The store may be gone after a failure (its host died) or frozen (its host is stopped), so every store operation
runs in a daemon thread joined within a bound: a failing rank always exits promptly. Rank 0 collects until every
rank has reported or the bound has passed, so a record that comes late still counts.

Any local process can reach the job's store (its port is in torchrun's agent store, which listens on every
interface), so a record in it carries an HMAC-SHA256 under a per-job key that no listener serves: rank 0 draws it at
start-up and broadcasts it over the process group (spmd_rl.runtime.distributed.start_runtime). The MAC covers the
rank whose key the record is stored under, so a genuine record copied under another rank's key fails the check,
and the job and its attempt are bound by the key itself, drawn afresh at every start-up: a stale record (an
earlier attempt's), a copied or a planted one is ignored and named in a line of its own.

A launcher may stop rank 0 before it prints the summary (mpirun kills every rank as soon as one dies). So when
$SPMD_RL_FAILURE_DIR names a directory (launch/mpirun.sh and launch/torchrun.sh on one host), every failing rank
also leaves its record there as a file, with the names of all ranks, and rank 0 a marker once it has spoken for the
job; after the job, `python -m spmd_rl.runtime.postmortem DIR` prints the same summary from the files unless the
marker is there. The files need no signature: the directory is the launcher script's own (mktemp -d: mode 0700), and
the summary ignores, with a line, a directory that another user owns or may write. No torch at module level: that
runs in the launcher script, after every rank is gone.

Over 400 lines: the records are written, signed, read and summarized here, so that what is signed and what is
checked stay in one file.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from spmd_rl.runtime.errors import COMM_ERROR_EXIT_CODE, USER_CODE_EXIT_CODE, USER_ERROR_EXIT_CODE

KEY = "spmd_rl/failure/rank{}"
PUBLISH_BOUND_S = 2.0  # how long a failing rank tries to leave its record before it exits anyway
COLLECT_GRACE_S = 3.0  # how long rank 0 waits for the other ranks' records
# ...and up to how long while several silent ranks could be the first cause: survivors that were blocked in a
# collective with the dead rank report later than those it talked to directly, and each record that arrives
# narrows the candidates down to the rank that really stopped.
AMBIGUOUS_GRACE_S = 10.0
POLL_S = 0.05
# A rank that failed this much later than every rank that timed out waiting on it was not running meanwhile.
STALL_MARGIN_S = 1.0
FROZEN_S = 2.0  # a rank that did not run for this long during its failed wait was stopped: the first cause
FAILURE_DIR_VARIABLE = "SPMD_RL_FAILURE_DIR"
SPOKEN_MARKER = "rank0-spoke"  # rank 0 printed the summary, or its own line speaks for the job


class _JobKey:
    key: bytes | None = None  # set on every rank of a distributed run at start-up (set_job_key)


def set_job_key(key: bytes) -> None:
    """The per-job secret this rank signs its store record with, and rank 0 checks the others' with."""
    _JobKey.key = bytes(key)


def sign(payload: bytes, key: bytes, rank: int) -> bytes:
    """payload + b"|" + the HMAC-SHA256 under key of rank's store key name and payload, in hex."""
    return payload + b"|" + _mac(payload, key, rank)


def verified(data: bytes, key: bytes, rank: int) -> bytes | None:
    """The payload of a record signed for rank, or None when its HMAC is not key's for rank (planted, stale, copied
    from another rank's key, damaged)."""
    payload, _, mac = data.rpartition(b"|")
    return payload if payload and hmac.compare_digest(mac, _mac(payload, key, rank)) else None


def _mac(payload: bytes, key: bytes, rank: int) -> bytes:
    return hmac.new(key, KEY.format(rank).encode() + b"|" + payload, hashlib.sha256).hexdigest().encode()


@dataclass(frozen=True)
class Failure:
    rank: int
    exit_code: int
    at: float  # time.time() when the rank failed
    peers: tuple[int, ...] = ()  # the ranks it was waiting on (a communication error's)
    timed_out: bool = False  # its wait expired (rather than a connection closing)
    frozen_s: float = 0.0  # how long the process did not run at all during its failed wait (SIGSTOP), if it knows

    @property
    def kind(self) -> str:
        known = {
            USER_ERROR_EXIT_CODE: "user error",
            COMM_ERROR_EXIT_CODE: "communication error",
            USER_CODE_EXIT_CODE: "error in user code",
            130: "interrupted (SIGINT)",
        }
        if self.exit_code in known:
            return known[self.exit_code]
        if self.exit_code > 128:
            try:
                return f"stopped by {signal.Signals(self.exit_code - 128).name}"
            except ValueError:
                pass
        return f"exit code {self.exit_code}"

    def encode(self) -> bytes:
        fields = [self.rank, self.exit_code, self.at, list(self.peers), self.timed_out, self.frozen_s]
        return json.dumps(fields).encode()

    @classmethod
    def decode(cls, data: bytes) -> Failure:
        rank, exit_code, at, peers, timed_out, frozen_s = json.loads(data.decode())
        peers = tuple(int(p) for p in peers)
        return cls(int(rank), int(exit_code), float(at), peers, bool(timed_out), float(frozen_s))


def first_cause(own: Failure, others: dict[int, Failure], world_size: int, describe_rank: Callable[[int], str]) -> str:
    """The summary rank 0 prints, from its own failure and the records that reached it (see the module doc)."""
    records = {**others, own.rank: own}
    communication = sorted(r for r, f in records.items() if f.exit_code == COMM_ERROR_EXIT_CODE)
    causes = [f for f in records.values() if f.exit_code != COMM_ERROR_EXIT_CODE]
    if causes:
        first = min(causes, key=lambda f: f.at)
        follow = f"; the communication errors of ranks {communication} follow from it" if communication else ""
        return f"{describe_rank(first.rank)} failed first ({first.kind}: see its line){follow}"
    silent = [r for r in range(world_size) if r not in records]
    waited_on = sorted({p for f in records.values() for p in f.peers if p in silent})
    if waited_on:
        waiters = sorted(r for r, f in records.items() if set(f.peers) & set(waited_on))
        return (
            f"{_names(waited_on, describe_rank)} stopped responding first: ranks {waiters} waited on "
            f"{_them(waited_on)} and {_it(waited_on)} reported no error (killed, stopped or hung); the other "
            f"ranks' errors follow from it"
        )
    frozen = sorted(f.rank for f in records.values() if f.frozen_s >= FROZEN_S)
    if frozen:
        waiters = sorted(r for r, f in records.items() if r not in frozen)
        longest = max(records[r].frozen_s for r in frozen)
        return (
            f"{_names(frozen, describe_rank)} stopped responding first: {_it(frozen)} did not run at all for "
            f"{longest:.0f} s (stopped, e.g. SIGSTOP, or its machine suspended) while ranks {waiters} waited; "
            f"their errors follow from it"
        )
    timed_out = [f for f in records.values() if f.timed_out]
    stalled = _stalled(timed_out, records)
    if stalled:
        waiters = sorted(f.rank for f in timed_out if set(f.peers) & set(stalled))
        return (
            f"{_names(stalled, describe_rank)} stopped responding first: ranks {waiters} timed out waiting on "
            f"{_it(stalled)}, and {_it(stalled)} failed only after them (stopped or stalled, then found its peers gone)"
        )
    if silent:
        return (
            f"ranks {silent} reported no error (killed, stopped or hung): the likely first cause; ranks "
            f"{communication} failed waiting"
        )
    first = min(records.values(), key=lambda f: f.at)
    return f"every rank failed with a communication error; the first was {describe_rank(first.rank)}"


def _stalled(timed_out: list[Failure], records: dict[int, Failure]) -> list[int]:
    """The ranks others timed out waiting on that were not themselves waiting: they did not time out, or they
    failed long after every rank that waited on them (their deadline passed while they were stopped)."""
    stalled = []
    for peer in sorted({p for f in timed_out for p in f.peers}):
        own = records.get(peer)
        last_waiter = max(f.at for f in timed_out if peer in f.peers)
        if own is None or not own.timed_out or own.at > last_waiter + STALL_MARGIN_S:
            stalled.append(peer)
    return stalled


def _names(ranks: list[int], describe_rank: Callable[[int], str]) -> str:
    return ", ".join(describe_rank(r) for r in ranks)


def _it(ranks: list[int]) -> str:
    return "it" if len(ranks) == 1 else "they"


def _them(ranks: list[int]) -> str:
    return "it" if len(ranks) == 1 else "them"


def after_failure(failure: Failure, world_size: int, describe_rank: Callable[[int], str]) -> int:
    """On a failing rank of a distributed run, before it exits: leave this rank's record, or, on rank 0 after a
    communication error, gather the others' and print the summary. Never raises, never blocks for long. Returns
    the job's exit code as far as this rank knows it: on rank 0 after a communication error, the first cause's
    among the records that reached it (what the summary names, and run.lock records); else this rank's own."""
    others: dict[int, Failure] = {}
    try:
        # first: the launcher may kill this rank any moment
        in_file = _leave_record_file(failure, world_size, describe_rank)
        store = _default_store()
        if store is None:
            return failure.exit_code
        key = _JobKey.key
        if key is None:  # the key is set right after the group exists: a failure before it has no store record
            return failure.exit_code
        if failure.rank != 0:
            _bounded(
                lambda: store.set(KEY.format(failure.rank), sign(failure.encode(), key, failure.rank)), PUBLISH_BOUND_S
            )
        elif failure.exit_code == COMM_ERROR_EXIT_CODE:
            forged: list[int] = []
            complete = False
            try:
                _bounded(
                    lambda: _collect(store, world_size, others, failure, key, forged),
                    AMBIGUOUS_GRACE_S + PUBLISH_BOUND_S,
                )
                complete = True
            finally:
                if forged:
                    print(
                        f"spmd_rl: rank 0: ignored the record{'s' if len(forged) > 1 else ''} for rank"
                        f"{'s' if len(forged) > 1 else ''} {', '.join(map(str, sorted(set(forged))))} in the job's "
                        f"store: not signed for that rank by this job (written by another process, copied from another "
                        f"rank's key, or left by an earlier attempt)",
                        file=sys.stderr,
                        flush=True,
                    )
                # A launcher's SIGTERM cuts the wait short: the summary of what arrived, unless the launcher
                # script prints it after the job from the files, which hold every record written meanwhile.
                if complete or not in_file:
                    print(
                        f"spmd_rl: job summary: {first_cause(failure, dict(others), world_size, describe_rank)}",
                        file=sys.stderr,
                        flush=True,
                    )
                    _leave_marker()
        else:  # rank 0's own line (not a knock-on) speaks for the job, as it always did: no summary
            _leave_marker()
    except BaseException:  # noqa: BLE001 - a broken store or a second signal must not change how the rank exits
        pass
    return _job_code([failure, *dict(others).values()])  # a copy: a collector cut short may still add to it


def _job_code(records: Iterable[Failure]) -> int:
    """The first failing rank's code among records that did not fail waiting on another (2, 4, ...), else 3."""
    causes = [f for f in records if f.exit_code != COMM_ERROR_EXIT_CODE]
    return min(causes, key=lambda f: f.at).exit_code if causes else COMM_ERROR_EXIT_CODE


def _collect(store, world_size: int, into: dict[int, Failure], own: Failure, key: bytes, forged: list[int]) -> None:
    """Signed records of ranks 1..world_size-1 into `into` as they arrive, until every rank has reported or, with
    silent ranks left, for COLLECT_GRACE_S, and on (up to AMBIGUOUS_GRACE_S) while the records that came leave the
    cause open: no failure but communication errors, and not exactly one silent rank among those the failed ranks
    waited on (the ranks that waited on the dead one directly may report last). A record without this job's
    signature goes to `forged` (its rank stays missing: its real record may still come)."""
    start = time.monotonic()
    missing = set(range(1, world_size))

    def keep_waiting() -> bool:
        waited = time.monotonic() - start
        if waited < COLLECT_GRACE_S:
            return True
        records = [own, *into.values()]
        if any(f.exit_code != COMM_ERROR_EXIT_CODE for f in records):  # a cause has reported (rule 1)
            return False
        candidates = {p for f in records for p in f.peers if p in missing}
        return waited < AMBIGUOUS_GRACE_S and len(candidates) != 1

    while missing and keep_waiting():
        for rank in sorted(missing):
            name = KEY.format(rank)
            if store.check([name]):
                payload = verified(store.get(name), key, rank)
                if payload is None:
                    if rank not in forged:
                        forged.append(rank)
                    continue
                into[rank] = Failure.decode(payload)
                missing.discard(rank)
        time.sleep(POLL_S)


def _bounded(action: Callable[[], None], bound_s: float) -> None:
    def quietly() -> None:
        try:
            action()
        except Exception:  # noqa: BLE001 - the store is gone: nothing to report to, nothing to print
            pass

    thread = threading.Thread(target=quietly, daemon=True)
    thread.start()
    thread.join(bound_s)


def _default_store():
    try:
        import torch.distributed as dist  # here, not at module level: summarize_files runs without torch
        from torch.distributed import distributed_c10d

        return distributed_c10d._get_default_store() if dist.is_initialized() else None
    except Exception:  # noqa: BLE001 - no store, no summary
        return None


def _failure_dir() -> Path | None:
    """$SPMD_RL_FAILURE_DIR, under torchrun its attempt<N> subdirectory: with --max-restarts, the ranks of a
    restarted attempt must not find the failed attempt's records (launch/common.sh reads the last attempt's)."""
    directory = os.environ.get(FAILURE_DIR_VARIABLE)
    if not directory:
        return None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    return Path(directory) / f"attempt{int(attempt)}" if attempt and attempt.isdigit() else Path(directory)


def begin_attempt() -> None:
    """Make this torchrun attempt's record directory (attempt<N>) at start-up, before any rank can fail: launch/*.sh
    summarize the last attempt's records, and a restarted attempt that ended cleanly (a checkpointed stop) left none,
    so its directory did not exist and the script printed the failed attempt's summary after the stop line ('job
    summary: rank 1 ... stopped responding first' of a failure the restart had recovered from; fault pass 6, MR).
    Nothing without $SPMD_RL_FAILURE_DIR or outside torchrun; never raises."""
    directory = _failure_dir()
    if directory is not None and os.environ.get("TORCHELASTIC_RESTART_COUNT"):
        with contextlib.suppress(OSError):
            directory.mkdir(exist_ok=True)


def _leave_record_file(failure: Failure, world_size: int, describe_rank: Callable[[int], str]) -> bool:
    """This rank's record, and every rank's name (a silent rank cannot give its own), as DIR/rank<R>.json: written
    under another name and renamed, so the launcher never reads half a record. A local file of a few hundred
    bytes: no bound needed. Whether it was written; never raises."""
    directory = _failure_dir()
    if directory is None:
        return False
    try:
        record = {
            "failure": json.loads(failure.encode()),
            "world_size": world_size,
            "names": [describe_rank(rank) for rank in range(world_size)],
        }
        directory.mkdir(exist_ok=True)  # an attempt's subdirectory (see _failure_dir)
        path = directory / f"rank{failure.rank}.json"
        partial = directory / f".rank{failure.rank}.json.partial"
        partial.write_text(json.dumps(record))
        partial.replace(path)
        return True
    except Exception:  # noqa: BLE001 - no directory (another host, removed): the store still has the record
        return False


def leave_own_record(rank: int, exit_code: int) -> None:
    """This rank's record file alone, without the store or the ranks' names: for a process that ends at once with
    nothing else running (the watchdog's exit), so that launch/*.sh take its code rather than reading a rank that
    ended before it could say why (fault pass 6, U3b: a plug-in's import hanging on rank 1). Never raises."""
    _leave_record_file(Failure(rank, exit_code, time.time()), 0, str)


def a_rank_has_failed() -> bool:
    """Whether a rank of this job has left a failure record in $SPMD_RL_FAILURE_DIR (False when it is not set)."""
    directory = _failure_dir()
    try:
        return directory is not None and any(directory.glob("rank*.json"))
    except OSError:
        return False


def _leave_marker() -> None:
    directory = _failure_dir()
    if directory is not None:
        try:
            (directory / SPOKEN_MARKER).touch()
        except OSError:
            pass


def summarize_files(directory: Path) -> str | None:
    """The summary line from the record files of DIR, or None: no record, or rank 0 spoke for the job already."""
    if (directory / SPOKEN_MARKER).exists():
        return None
    read = _read_record_files(directory)
    if read is None:
        return None
    records, names, world_size = read

    def describe(rank: int) -> str:
        return names[rank] if 0 <= rank < len(names) else f"rank {rank}"

    own = records.pop(min(records))
    return f"spmd_rl: job summary: {first_cause(own, records, max(world_size, own.rank + 1), describe)}"


def job_exit_code(directory: Path) -> int | None:
    """The job's exit code from the record files of DIR: the first failing rank's that did not fail waiting on
    another (2, 4, ...), else 3 (every record a communication error); None without records. What launch/common.sh
    exits with: torchrun and mpirun exit 1 for any failure, and rank 0's own code may be a knock-on (3, or a
    signal from the launcher) of another rank's error."""
    read = _read_record_files(directory, quiet=True)
    if read is None:
        return None
    return _job_code(read[0].values())


def _read_record_files(directory: Path, quiet: bool = False) -> tuple[dict[int, Failure], list[str], int] | None:
    """(records by rank, every rank's name, world size) from DIR's record files, or None when it holds none or
    another user could have written them (said in a line unless quiet)."""
    foreign = _not_private(directory)
    if foreign:
        if not quiet:
            print(
                f"spmd_rl: job summary: ignored the failure records in {directory}: {foreign}",
                file=sys.stderr,
                flush=True,
            )
        return None
    records: dict[int, Failure] = {}
    names: list[str] = []
    world_size = 0
    for path in sorted(directory.glob("rank*.json")):
        try:
            record = json.loads(path.read_text())
            failure = Failure.decode(json.dumps(record["failure"]).encode())
            world_size = max(world_size, int(record["world_size"]))
            names = [str(name) for name in record["names"]] or names
        except (OSError, ValueError, KeyError, TypeError):
            continue  # a damaged file: the summary of the others
        records[failure.rank] = failure
    return (records, names, world_size) if records else None


def _not_private(directory: Path) -> str:
    """Why another user could have written records into directory (or its parent, the launcher's own directory
    when this is an attempt's), or '' when nobody but this user can."""
    for path in (directory, directory.parent) if directory.name.startswith("attempt") else (directory,):
        try:
            info = path.stat()
        except OSError as exc:
            return f"cannot read it ({exc.strerror})"
        if hasattr(os, "getuid") and info.st_uid != os.getuid():
            return f"{path} belongs to another user (uid {info.st_uid})"
        if info.st_mode & 0o022:
            return f"{path} may be written by other users (mode {info.st_mode & 0o777:o})"
    return ""


if __name__ == "__main__":  # launch/common.sh, after a failed job: python -m spmd_rl.runtime.postmortem DIR
    # The summary line on stderr (unless rank 0 spoke), the job's exit code on stdout.
    try:
        line = summarize_files(Path(sys.argv[1]))
        if line:
            print(line, file=sys.stderr, flush=True)
        code = job_exit_code(Path(sys.argv[1]))
        if code is not None:
            print(code, flush=True)
    except Exception:  # noqa: BLE001 - a summary is a courtesy: the launcher's exit code stands either way
        pass
