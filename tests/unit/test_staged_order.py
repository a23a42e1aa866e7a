"""The async inference rank's staged weight broadcast is waited on only once complete: with NCCL a wait() on an
incomplete broadcast would make the CUDA stream wait for it (a stall gloo cannot show), so the order is checked
here with work objects that fail when waited on early."""

from __future__ import annotations

import pytest
from harness.parts import receiving_weight_sync

from spmd_rl.comm.staged_weights import StagedWeights
from spmd_rl.runtime.errors import CommError


class CompletesAfter:
    """A posted broadcast that completes after `polls` calls of is_completed(); wait() before that fails."""

    def __init__(self, polls: int):
        self.polls_left = polls
        self.waited = False

    def is_completed(self) -> bool:
        self.polls_left -= 1
        return self.polls_left < 0

    def wait(self, timeout=None) -> bool:
        assert self.polls_left < 0, "wait() called before the broadcast completed"
        self.waited = True
        return True


def _staged(timeout_s: float) -> StagedWeights:
    return StagedWeights(receiving_weight_sync(timeout_s))


def test_wait_polls_until_complete_and_only_then_waits():
    staged = _staged(timeout_s=10)
    staged._works = works = [CompletesAfter(3), CompletesAfter(6)]
    staged.wait()
    assert all(work.waited for work in works)


def test_a_broadcast_that_never_completes_is_a_named_timeout():
    staged = _staged(timeout_s=0.05)
    staged.posted = 4
    staged._works = [CompletesAfter(10**9)]
    with pytest.raises(
        CommError,
        match=r"rank 1: weight broadcast number 4 from rank 0 .* did not respond within "
        r"dist.timeout_s=0.05s",
    ) as raised:
        staged.wait()
    assert raised.value.timed_out and raised.value.peers == (0,)
