"""Failures between ranks end the job within the timeout, with a message naming who waited for whom.

Gloo closes a pair when a wait on it expires, so the partner of a timed-out rank fails too, promptly.
"""

import datetime
import os

import pytest
import torch
import torch.distributed as dist
from harness.multiproc import run_ranks
from tensordict import TensorDict
from torch import nn

from spmd_rl.comm.channel_setup import open_channels
from spmd_rl.comm.weights import WeightSync
from spmd_rl.runtime.errors import COMM_ERROR_EXIT_CODE, CommError

SHORT = datetime.timedelta(seconds=2)
SETUP = datetime.timedelta(seconds=20)
DIED = 7


def message() -> TensorDict:
    return TensorDict({"obs": torch.zeros(4, 3)}, batch_size=[])


def describe(rank: int) -> str:
    return f"rank {rank} ({'inference' if rank == 0 else 'env'} {max(rank - 1, 0)})"


def _silent_peer(rank, world_size):
    if rank == 1:
        (_,), (obs,) = open_channels(
            sends=[(0, "done", message())], recvs=[(0, "obs", None)], me=1, timeout=SHORT, describe_rank=describe
        )
        with pytest.raises(CommError) as error:
            obs.recv()  # rank 0 never sends
        text = str(error.value)
        assert text.startswith("rank 1 (env 0): receive of message 1 on channel 'obs' from rank 0 (inference 0)")
        assert "failed: rank 0 (inference 0) did not respond within dist.timeout_s=2s" in text
        raise error.value
    (_,), (done,) = open_channels(
        sends=[(1, "obs", message())], recvs=[(1, "done", None)], me=0, timeout=SETUP, describe_rank=describe
    )
    done.recv()  # never arrives: fails once rank 1's expired wait closes the connection


def test_a_peer_that_never_sends_is_a_comm_error_naming_both_ranks():
    assert run_ranks(_silent_peer, 2, timeout_s=20, deadline_s=30) == [COMM_ERROR_EXIT_CODE] * 2


def _dies_mid_run(rank, world_size):
    if rank == 2:
        sends, _ = open_channels(
            sends=[(0, "obs", message()), (1, "obs", message())], recvs=[], me=2, timeout=SETUP, describe_rank=describe
        )
        for channel in sends:
            channel.send()
        os._exit(DIED)  # a crash: no exception, no cleanup
    _, (obs,) = open_channels(sends=[], recvs=[(2, "obs", None)], me=rank, timeout=SETUP, describe_rank=describe)
    obs.recv()
    obs.recv()


def test_a_rank_that_dies_mid_run_makes_its_peers_exit_non_zero():
    assert run_ranks(_dies_mid_run, 3, timeout_s=20, deadline_s=40) == [COMM_ERROR_EXIT_CODE] * 2 + [DIED]


def _source_dies_before_broadcast(rank, world_size):
    torch.manual_seed(0)
    sync = WeightSync(
        nn.Linear(4, 4), dist.group.WORLD, src=0, me=rank, bucket_bytes=1 << 20, timeout=SHORT, describe_rank=describe
    )
    sync.broadcast(1)
    if rank == 0:
        os._exit(DIED)
    with pytest.raises(CommError, match=f"rank {rank} .*: weight broadcast from rank 0 \\(inference 0\\)"):
        sync.broadcast(2)
    raise CommError("as expected")


def test_a_weight_source_that_dies_makes_receivers_exit_non_zero():
    assert (
        run_ranks(_source_dies_before_broadcast, 3, timeout_s=20, deadline_s=30) == [DIED] + [COMM_ERROR_EXIT_CODE] * 2
    )
