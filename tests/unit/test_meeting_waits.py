"""The meeting before start (spmd_rl.runtime.meeting) waits by blocking, not polling: a rank waiting for another makes
a handful of store calls however long it waits (it made one every 20 ms), and every outcome keeps its line: go,
another rank's failed check heard at once, a timeout naming who waited for whom. In one process: the ranks are
threads around torch's in-process store, as the ranks of a job are processes around the job's TCPStore."""

from __future__ import annotations

import datetime
import json
import os
import signal
import threading
import time

import pytest
import torch.distributed as dist

from spmd_rl.runtime import meeting
from spmd_rl.runtime.errors import CommError, StopSignal

WAIT_S = 1.0  # how long the late rank keeps the other waiting


class CountingStore:
    """A store whose calls are counted (the waiting rank's, not the late rank's: each has its own)."""

    def __init__(self, store):
        self.store, self.calls = store, 0

    def __getattr__(self, name):
        self.calls += 1
        return getattr(self.store, name)

    def clone(self):  # the waits' own client: counted with this one (a HashStore needs no second connection)
        return self


def later(action, after_s: float = WAIT_S) -> threading.Thread:
    thread = threading.Thread(target=lambda: (time.sleep(after_s), action()), daemon=True)
    thread.start()
    return thread


def timeout(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def test_rank_0_waits_for_a_late_rank_without_polling():
    store = dist.HashStore()
    waiting = CountingStore(store)
    late = later(lambda: meeting.meet(store, 1, 2, timeout(60)))
    meeting.meet(waiting, 0, 2, timeout(60))
    late.join(60)
    assert not late.is_alive()
    assert waiting.calls <= 5, f"{waiting.calls} store calls while waiting {WAIT_S} s for rank 1"


def test_a_rank_waits_for_rank_0_without_polling():
    store = dist.HashStore()
    waiting = CountingStore(store)
    later(lambda: meeting.meet(store, 0, 2, timeout(60)))
    meeting.meet(waiting, 1, 2, timeout(60))  # returns on rank 0's "go"
    assert waiting.calls <= 5, f"{waiting.calls} store calls while waiting {WAIT_S} s for rank 0"


def test_a_failed_check_is_heard_at_once_and_rank_0_prints_its_line(capsys):
    store = dist.HashStore()
    failed = {"rank": 2, "exit_code": 2, "line": "spmd_rl: rank 2: error: its files are missing", "spoke": False}
    later(lambda: meeting._report(store, failed))  # rank 1 never comes: rank 2's failure is heard all the same
    with pytest.raises(meeting.StartAbandoned) as abandoned:
        meeting.meet(store, 0, 3, timeout(600))
    assert abandoned.value.exit_code == 2
    assert capsys.readouterr().err == "spmd_rl: rank 2: error: its files are missing\n"
    assert store.get(meeting.OUTCOME) == b"abandoned 2"


def test_ranks_started_with_another_world_size_are_refused_at_once(capsys):
    """Rank 1 started with WORLD_SIZE=3, rank 0 with 2: they met in init_process_group and waited there 53 s for a
    bound of 8, under torch's warnings (fault pass 4, V2). Rank 0 says it once, exit 2; the others end quietly."""
    store = dist.HashStore()
    meeting._report(store, {"rank": 1, "world_size": 3})
    with pytest.raises(meeting.StartAbandoned) as abandoned:
        meeting.meet(store, 0, 2, timeout(600))
    assert abandoned.value.exit_code == 2
    line = "spmd_rl: error: rank 1 was started with world size 3 and rank 0 with 2: start every rank with the same"
    assert capsys.readouterr().err.startswith(line)
    assert store.get(meeting.OUTCOME) == b"abandoned 2"


def test_rank_0s_timeout_names_the_ranks_it_did_not_hear_from():
    store = dist.HashStore()
    meeting._report(store, {"rank": 2})  # rank 2 arrived; rank 1 took a number and never wrote its report
    store.add(meeting.COUNT, 1)
    with pytest.raises(CommError, match=r"rank 0: ranks \[1\] did not join within dist.timeout_s=0.5") as error:
        meeting.meet(store, 0, 3, timeout(0.5))
    assert error.value.peers == (1,) and error.value.timed_out


def test_rank_0s_timeout_over_tcp_comes_at_the_bound():
    """Ranks started by hand, one never comes: rank 0's line came dist.timeout_s + 120 s late (fault pass 4, B6),
    after two warnings of the store's client, because its question which ranks it had heard of queued behind the
    expired wait on the same TCP client. The waits now have a client of their own."""
    server = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, timeout=timeout(300), wait_for_workers=False)
    outcome: dict = {}

    def rank_0():
        try:
            meeting.meet(server, 0, 2, timeout(0.5))
        except CommError as error:
            outcome["error"] = error

    thread = threading.Thread(target=rank_0, daemon=True)
    thread.start()
    thread.join(60)  # far past the bound; the queued question waited WAIT_MARGIN_S (120 s)
    assert not thread.is_alive(), "rank 0 still waiting 60 s after its 0.5 s bound"
    assert "ranks [1] did not join within dist.timeout_s=0.5" in str(outcome["error"])
    server.set(meeting.REPORT.format(1), json.dumps({"rank": 1}))  # ends the expired wait's thread before teardown


def test_a_ranks_timeout_names_rank_0():
    with pytest.raises(CommError, match=r"rank 1: rank 0 did not open the process group within dist.timeout_s=0.5"):
        meeting.meet(dist.HashStore(), 1, 2, timeout(0.5))


def test_a_stop_signal_ends_the_wait_at_once():
    def stop(signum, frame):
        raise StopSignal("SIGUSR1", signum)

    previous = signal.signal(signal.SIGUSR1, stop)
    try:
        later(lambda: os.kill(os.getpid(), signal.SIGUSR1), after_s=0.3)
        with pytest.raises(StopSignal):  # not after dist.timeout_s (pytest's own timeout would end a hang)
            meeting.meet(dist.HashStore(), 0, 2, timeout(3600))
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_a_failed_rank_tells_rank_0_through_its_own_connection():
    store = dist.HashStore()
    later(lambda: store.set(meeting.OUTCOME, "abandoned 2"), after_s=0.3)
    assert meeting._tell(lambda: store, 1, 2, "spmd_rl: rank 1: error: ...", False, bound_s=60)
    record = json.loads(store.get(meeting.REPORT.format(1)))
    assert record == {"rank": 1, "exit_code": 2, "line": "spmd_rl: rank 1: error: ...", "spoke": False}
