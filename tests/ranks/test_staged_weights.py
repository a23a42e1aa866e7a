"""StagedWeights over a real 2-rank gloo group: the receiver posts each broadcast into its staging copy, its live
weights stay as they were until swap(), and then equal the sender's; version() reports the staged version."""

from __future__ import annotations

import datetime

import pytest
import torch
from harness.multiproc import assert_all_ok, run_ranks
from torch import nn

from spmd_rl.comm.staged_weights import StagedWeights
from spmd_rl.comm.weights import WeightSync

TIMEOUT = datetime.timedelta(seconds=20)


def sender_weights(version: int) -> dict[str, torch.Tensor]:
    """What trainer 0 holds when it broadcasts `version` (distinct values per version and per element)."""
    return {
        "weight": torch.arange(6, dtype=torch.float32).view(2, 3) + 10.0 * version,
        "bias": torch.tensor([-1.0, -2.0]) * version,
    }


def _staged_broadcasts(rank, world_size):
    torch.manual_seed(rank)  # the two ranks start from different weights
    policy = nn.Linear(3, 2)
    sync = WeightSync(policy, None, src=0, me=rank, bucket_bytes=1 << 20, timeout=TIMEOUT)
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))
    if rank == 0:
        with pytest.raises(ValueError, match="for the receivers"):
            StagedWeights(sync)
        for version in (1, 2):
            with torch.no_grad():
                for name, value in sender_weights(version).items():
                    getattr(policy, name).copy_(value)
            assert sync.broadcast(version) == version
            sync.verify(version)
        return

    staged = StagedWeights(sync)
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    out_before = policy(x).detach()
    for version in (1, 2):
        staged.post()
        assert staged.posted == version
        staged.wait()  # the broadcast is complete ...
        assert staged.ready()
        assert staged.version() == version
        for name, value in policy.state_dict().items():
            assert torch.equal(value, before[name]), f"{name} changed before swap() (version {version})"
        assert torch.equal(policy(x).detach(), out_before)  # ... and the forward pass still uses the old weights
        assert staged.swap() == version
        assert not staged.ready()  # nothing posted now
        for name, value in sender_weights(version).items():
            assert torch.equal(getattr(policy, name).detach(), value), f"{name} after swap (version {version})"
        assert not torch.equal(policy(x).detach(), out_before)
        assert int(sync._header[0]) == version  # the live buckets carry the version too
        sync.verify(version)  # bit for bit the sender's, checked by both ranks
        before = {k: v.clone() for k, v in policy.state_dict().items()}
        out_before = policy(x).detach()


def test_staged_weights_reach_the_live_module_only_at_swap():
    assert_all_ok(run_ranks(_staged_broadcasts, 2, timeout_s=20))
