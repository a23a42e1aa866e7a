"""Weight broadcast over a real gloo group: exact copies of parameters and buffers, versions, and verify."""

import datetime

import pytest
import torch
import torch.distributed as dist
from harness.multiproc import assert_all_ok, run_ranks
from torch import nn

from spmd_rl.comm.weights import WeightMismatchError, WeightSync, bucket_checksum

TIMEOUT = datetime.timedelta(seconds=20)
BUCKET_BYTES = 512  # small, so the test model spans several buckets and has an oversized tensor


class Policy(nn.Module):
    """Parameters plus the kinds of buffers real models carry: float64 statistics, an int64 counter, a bool mask."""

    def __init__(self, seed: int, obs: int = 5, hidden: int = 40):
        super().__init__()
        torch.manual_seed(seed)
        self.body = nn.Sequential(nn.Linear(obs, hidden), nn.Tanh(), nn.Linear(hidden, 3))
        self.norm = nn.BatchNorm1d(hidden)  # running stats (float32) and an int64 counter
        self.log_std = nn.Parameter(torch.randn(3))
        self.register_buffer("obs_mean", torch.randn(obs, dtype=torch.float64))
        self.register_buffer("obs_count", torch.randint(0, 100, (), dtype=torch.int64))
        self.register_buffer("mask", torch.rand(obs) > 0.5)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.body[2](torch.tanh(self.norm(self.body[0](obs * self.mask)))) + self.log_std

    def train_step(self, step: int) -> None:
        """What a trainer does between broadcasts: update parameters in place, replace a buffer wholesale."""
        with torch.no_grad():
            for p in self.parameters():
                p.add_(0.01 * (step + 1))
        self.norm.running_mean.mul_(0.5)
        self.obs_count += step
        self.obs_mean = self.obs_mean + 1.0  # replaced, not updated in place


def state(module: nn.Module) -> dict:
    return {k: v.clone() for k, v in module.state_dict().items()}


def assert_state_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


def describe(rank: int) -> str:
    return f"rank {rank} ({'trainer' if rank == 0 else 'inference'} {0 if rank == 0 else rank - 1})"


def test_checksum_sees_every_word_and_its_position():
    data = torch.randint(0, 256, (4096,), dtype=torch.uint8)
    reference = bucket_checksum(data)
    assert bucket_checksum(data.clone()) == reference
    for byte in (0, 1, 2047, 4095):
        for bit in (0, 7):
            flipped = data.clone()
            flipped[byte] ^= 1 << bit
            assert bucket_checksum(flipped) != reference, (byte, bit)
    words = data.view(torch.int32).clone()
    words[[3, 900]] = words[[900, 3]]
    assert bool(words[3] != words[900]) and bucket_checksum(words.view(torch.uint8)) != reference


def _broadcast_and_verify(rank, world_size):
    group = dist.new_group([0, 1, 2], timeout=TIMEOUT)  # rank 3 is not a member, as an env rank is not
    policy = Policy(seed=rank)  # every rank starts from different weights
    if rank == 3:
        with pytest.raises(ValueError, match="rank 3 .* is not a member of the weight group"):
            WeightSync(policy, group, src=0, me=3, bucket_bytes=BUCKET_BYTES, timeout=TIMEOUT, describe_rank=describe)
        # It stays until the members are done: a rank that left at once closed its gloo connections while a slower
        # rank still made its own (2026-12-07 CI at load: "connectFullMesh failed ... Connection closed by peer").
        dist.barrier()
        return
    sync = WeightSync(policy, group, src=0, me=rank, bucket_bytes=BUCKET_BYTES, timeout=TIMEOUT, describe_rank=describe)
    assert len(sync.buckets) >= 3
    dtypes_per_bucket = [{e.view.dtype for e in sync.entries if e.bucket == b} for b in range(len(sync.buckets))]
    assert any(len(dtypes) > 1 for dtypes in dtypes_per_bucket)  # dtypes share a bucket
    assert any(b.numel() > BUCKET_BYTES for b in sync.buckets)  # body.0.weight alone exceeds a bucket
    reference = Policy(seed=0)  # what the source holds, rebuilt locally

    assert sync.broadcast(version=1 if rank == 0 else 0) == 1
    assert_state_equal(state(policy), state(reference))
    sync.verify(1)

    for step in range(2):  # the source trains; receivers follow
        if rank == 0:
            policy.train_step(step)
            policy(torch.randn(8, 5)).sum().backward()  # autograd through parameters that are views
            with torch.no_grad():  # an SGD step (torch.optim costs seconds to import)
                for p in policy.parameters():
                    p.sub_(0.1 * p.grad)
        assert sync.broadcast(version=2 + step) == 2 + step
        if rank == 0:  # the receivers' reference: the source's state
            for peer in (1, 2):
                for tensor in state(policy).values():
                    dist.send(tensor.contiguous(), dst=peer, group=group)
        else:
            expected = {k: torch.empty_like(v) for k, v in state(policy).items()}
            for tensor in expected.values():
                dist.recv(tensor, src=0, group=group)
            assert_state_equal(state(policy), expected)
        sync.verify(2 + step)
    assert policy.obs_mean.data_ptr() == sync.entries[[e.name for e in sync.entries].index("obs_mean")].view.data_ptr()

    with pytest.raises(
        WeightMismatchError, match="the source rank 0 \\(trainer 0\\) holds version 3, not the version 2 being verified"
    ):
        sync.verify(2)  # a stale version is an error, even if bits agree

    # A receiver whose copy drifts (one element of one parameter) is caught by every member.
    corrupted = next(e for e in sync.entries if e.name == "body.2.bias")
    if rank == 2:
        with torch.no_grad():
            policy.body[2].bias[1] += 1e-6
    with pytest.raises(WeightMismatchError) as error:
        sync.verify(3)
    message = str(error.value)
    assert f"rank 2 (inference 1) differs from the source rank 0 (trainer 0) in bucket {corrupted.bucket} " in message
    assert "body.2.bias" in message and "version 3" in message and "rank 1 (inference 0) differs" not in message

    # A member that built another model is refused when the WeightSync is built, on every member.
    other = Policy(seed=0, hidden=41 if rank == 1 else 40)
    with pytest.raises(WeightMismatchError, match="rank 1 \\(inference 0\\) .* differs from the source rank 0"):
        WeightSync(other, group, src=0, me=rank, bucket_bytes=BUCKET_BYTES, timeout=TIMEOUT, describe_rank=describe)
    dist.barrier()  # with rank 3


def test_broadcast_copies_parameters_and_buffers_exactly_and_verify_catches_drift():
    assert_all_ok(run_ranks(_broadcast_and_verify, 4, timeout_s=30))
