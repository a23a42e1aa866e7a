"""Failure records no other process can write (issue 30 item 4): a record planted in the job's store the way an
adversarial local user would (connect to the store's port, find the key names, write) is ignored and named, and the
summary blames the rank that really stopped; record files in a directory other users may write are not trusted."""

from __future__ import annotations

import datetime
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch.distributed as dist

from spmd_rl.runtime import postmortem
from spmd_rl.runtime.distributed import start_runtime
from spmd_rl.runtime.errors import COMM_ERROR_EXIT_CODE, USER_CODE_EXIT_CODE
from spmd_rl.runtime.launch import LaunchInfo
from spmd_rl.runtime.postmortem import KEY, Failure, after_failure, sign

REPO = Path(__file__).resolve().parents[2]
NAMES = ["rank 0 (trainer 0)", "rank 1 (inference 0)", "rank 2 (env 0)", "rank 3 (env 1)"]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _lines_after_planting(capfd, plant) -> list[str]:
    """Rank 0's error lines when rank 2 has reported that it waited on rank 3 (killed: it reports nothing), another
    process has then written into the job's store with plant(store, the record keys' prefix), and rank 0 reports."""
    port = _free_port()
    launch = LaunchInfo(
        "mpi", rank=0, world_size=1, local_rank=0, local_world_size=1, init_method=f"tcp://127.0.0.1:{port}"
    )
    start_runtime(launch, "cpu", 30.0)  # the group, and the job's key from rank 0's broadcast
    try:
        after_failure(Failure(2, COMM_ERROR_EXIT_CODE, 100.0, peers=(3,)), 4, NAMES.__getitem__)
        attacker = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=10))
        (genuine,) = [name for name in attacker.list_keys() if name.endswith(KEY.format(2))]
        plant(attacker, genuine.removesuffix(KEY.format(2)))
        capfd.readouterr()
        after_failure(Failure(0, COMM_ERROR_EXIT_CODE, 100.5, peers=(3,)), 4, NAMES.__getitem__)
    finally:
        dist.destroy_process_group()
    return capfd.readouterr().err.splitlines()


def _ignored_and_rank_3_blamed(ignored: int) -> list[str]:
    return [
        f"spmd_rl: rank 0: ignored the record for rank {ignored} in the job's store: not signed for that rank by this "
        "job (written by another process, copied from another rank's key, or left by an earlier attempt)",
        "spmd_rl: job summary: rank 3 (env 1) stopped responding first: ranks [0, 2] waited on it and it reported no "
        "error (killed, stopped or hung); the other ranks' errors follow from it",
    ]


def test_a_record_planted_in_the_job_store_is_ignored_and_named(capfd):
    def plant(store, prefix):
        planted = Failure(1, USER_CODE_EXIT_CODE, 1.0)  # earliest, and not a communication error: rule 1 would blame it
        store.set(prefix + KEY.format(1), planted.encode())  # unsigned, as the pass planted it
        store.set(prefix + KEY.format(1), sign(planted.encode(), os.urandom(32), 1))  # signed with another key

    assert _lines_after_planting(capfd, plant) == _ignored_and_rank_3_blamed(1)


def test_record_files_in_a_directory_other_users_may_write_are_not_trusted(tmp_path, monkeypatch):
    monkeypatch.setenv("SPMD_RL_FAILURE_DIR", str(tmp_path))
    after_failure(Failure(2, COMM_ERROR_EXIT_CODE, 100.0, peers=(1,)), 4, NAMES.__getitem__)  # no group: file only
    summarize = [sys.executable, "-m", "spmd_rl.runtime.postmortem", str(tmp_path)]
    tmp_path.chmod(0o700)  # the launcher's mktemp -d
    done = subprocess.run(summarize, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.stderr.startswith("spmd_rl: job summary: rank 1 (inference 0) stopped responding first"), done
    tmp_path.chmod(0o777)
    done = subprocess.run(summarize, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.stderr.splitlines() == [
        f"spmd_rl: job summary: ignored the failure records in {tmp_path}: {tmp_path} may be written by other users "
        "(mode 777)"
    ], done
    assert postmortem.summarize_files(tmp_path) is None


def test_a_genuine_record_copied_under_another_ranks_key_is_ignored_and_named(capfd):
    def plant(store, prefix):
        store.set(prefix + KEY.format(3), store.get(prefix + KEY.format(2)))  # rank 3 would seem to have reported

    assert _lines_after_planting(capfd, plant) == _ignored_and_rank_3_blamed(3)
