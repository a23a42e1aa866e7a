"""A stop signal while the ranks meet (init_process_group) is the job's one line:
- it neither interrupts torch's store client sleeping between connects, which torch reports with a warning and a
  C++ stack trace on stderr, nor gets lost: the handler runs once the call has returned;
- before the process group exists, rank 0 alone speaks for the job (a launcher script when rank 0 could not)."""

import datetime
import os
import signal
import threading

import torch.distributed as dist
from harness.launch import free_port

from spmd_rl.run.driver import _report_failure
from spmd_rl.runtime.errors import StopSignal
from spmd_rl.runtime.launch import LaunchInfo
from spmd_rl.runtime.signals import signals_held_off


def test_a_signal_during_the_store_connect_is_handled_after_it_and_torch_logs_nothing(capfd):
    port = free_port()
    handled: list[int] = []
    servers: list[dist.TCPStore] = []
    saved = signal.signal(signal.SIGTERM, lambda signum, frame: handled.append(signum))
    # The signal comes while the client sleeps between refused connects; the server comes a little later.
    signaller = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM))
    server = threading.Timer(
        2.0, lambda: servers.append(dist.TCPStore("127.0.0.1", port, 2, True, wait_for_workers=False))
    )
    try:
        signaller.start()
        server.start()
        with signals_held_off():
            client = dist.TCPStore("127.0.0.1", port, 2, False, timeout=datetime.timedelta(seconds=30))
        client.set("met", "1")
        assert handled == [signal.SIGTERM]
        assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == set(), "the signals stay blocked after the section"
    finally:
        signaller.join()
        server.join()
        signal.signal(signal.SIGTERM, saved)
    err = capfd.readouterr().err
    assert "Interrupted system call" not in err and "TCPStore.cpp" not in err, err


def test_before_the_group_exists_a_signal_is_rank_0s_line_alone_and_after_it_every_rank_says_its_own(
    capsys, monkeypatch
):
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "0")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")  # a job of two ranks: the lines name them (not in one process)

    def report(rank: int, started: bool) -> tuple[int, bool]:
        launch = LaunchInfo("mpi", rank, 2, rank, 2, "tcp://127.0.0.1:1")
        code, waited, spoke = _report_failure(StopSignal("SIGTERM", 15), launch, f"rank {rank}", started=started)
        return code, spoke

    assert report(1, started=False) == (143, False)
    assert capsys.readouterr().err == ""
    assert report(0, started=False) == (143, True)
    # "while starting", as main.py's early handlers say it (fault pass 6, M3: rank 0 waiting for its peers)
    assert capsys.readouterr().err == "spmd_rl: rank 0: stopped by SIGTERM while starting, before the run began\n"
    assert report(1, started=True) == (143, True)  # a signal to one rank: its line, and its record for rank 0
    assert capsys.readouterr().err == "spmd_rl: rank 1: stopped by SIGTERM\n"
