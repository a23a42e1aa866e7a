"""Weight sync in which every FSDP trainer sends its own shards (ShardedWeightSource) and the inference ranks
receive each trainer's rows straight into their buckets (WeightSync with senders): the received weights are the
gathered full state, bit for bit, in fp32 and bf16 on the wire, with uneven shards (3 trainers), frozen parameters
sent once, verify, and the async engine's staged receive. Real gloo ranks."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from harness.multiproc import run_ranks
from harness.parts import FrozenEncoderNet, learn_and_publish, save_full_weights
from torch import nn

from spmd_rl.comm import sharding
from spmd_rl.comm.staged_weights import StagedWeights
from spmd_rl.comm.weight_sources import ShardedWeightSource
from spmd_rl.comm.weights import HEADER_BYTES, WeightSync, lay_out, shard_pieces

TRAINERS, RECEIVERS = [0, 1, 2], [3, 4]


def _send(rank: int, world_size: int, out: str, wire: str, staged: bool) -> None:
    trainers = dist.new_group(TRAINERS)
    weights = dist.new_group([TRAINERS[0], *RECEIVERS])
    senders = dist.new_group(TRAINERS + RECEIVERS)
    wire_dtype = torch.bfloat16 if wire == "bf16" else None
    net = FrozenEncoderNet(head_width=17, outputs=1)
    bucket_bytes = 2048  # several buckets
    if rank in RECEIVERS:
        if wire_dtype is not None:
            sharding.cast_parameters(net, wire_dtype)
        sync = WeightSync(
            net, weights, src=0, me=rank, bucket_bytes=bucket_bytes, timeout=90, senders=TRAINERS, sender_group=senders
        )
        if staged:
            stage = StagedWeights(sync)
            stage.post()
            assert stage.swap() == 7
            stage.post()
            assert stage.version() == 8
            assert stage.swap() == 8
        else:
            assert sync.broadcast(-1) == 7
            assert sync.broadcast(-1) == 8
        sync.verify(8)
        if rank == RECEIVERS[-1]:
            torch.save({k: v.clone() for k, v in net.state_dict().items()}, f"{out}/received.pt")
        return
    sharding.shard_policy(net, trainers, torch.device("cpu"), [], bf16=False)
    optimizer = torch.optim.Adam([p for p in net.parameters() if p.requires_grad], lr=0.01)
    source = ShardedWeightSource(
        net, weights if rank == 0 else None, src=0, me=rank, bucket_bytes=bucket_bytes, timeout=90,
        wire_dtype=wire_dtype, senders=TRAINERS, sender_group=senders, receivers=RECEIVERS,
    )  # fmt: skip
    if wire_dtype is not None:  # the first sync's casts pass through the cast ring more than once (it wraps)
        casts = sum(p.end - p.start for bucket in source.pieces for p in bucket if p.sender == rank and p.entry)
        assert source._ring_bytes(range(len(source.bucket_sizes))) < casts
    for version in (7, 8):
        learn_and_publish(net, optimizer, source, rank, version)
    source.verify(8)
    save_full_weights(net, rank, f"{out}/trainer.pt")


@pytest.mark.parametrize("wire,staged", [("fp32", False), ("bf16", False), ("fp32", True)])
def test_receivers_hold_the_full_weights_each_trainer_sent_its_rows_of(tmp_path, wire, staged):
    import torch.optim  # noqa: F401 - imported by the parent so the forked ranks need not (torch._dynamo: seconds)

    assert run_ranks(_send, 5, str(tmp_path), wire, staged, timeout_s=120) == [0] * 5
    full, received = torch.load(tmp_path / "trainer.pt"), torch.load(tmp_path / "received.pt")
    assert sorted(full) == sorted(received)
    for key, value in full.items():
        expected = value.to(torch.bfloat16) if wire == "bf16" and value.dtype == torch.float32 else value
        assert received[key].dtype == expected.dtype, key
        assert torch.equal(received[key], expected), key


def _send_through_the_ring(rank: int, world_size: int, out: str) -> None:
    """2 trainers, 1 receiver; bf16 on the wire; pieces of 8 MiB (more than the sockets take at once) and a cast
    ring of one piece, so every cast reuses the ring bytes the previous piece was sent from."""
    trainers, weights = dist.new_group([0, 1]), dist.new_group([0, 2])
    torch.manual_seed(0)
    net = nn.Sequential(*(nn.Linear(2048, 4096, bias=False) for _ in range(3)))
    bucket_bytes = 16 << 20  # one weight (4096 x 2048 in bf16) a bucket; the ring is half of one
    if rank == 2:
        sharding.cast_parameters(net, torch.bfloat16)
        sync = WeightSync(
            net, weights, src=0, me=2, bucket_bytes=bucket_bytes, timeout=90, senders=[0, 1],
            sender_group=dist.group.WORLD,
        )  # fmt: skip
        time.sleep(0.5)  # the trainers' first sends wait for these receives, their later casts for those sends
        assert sync.broadcast(-1) == 1
        torch.save({k: v.clone() for k, v in net.state_dict().items()}, f"{out}/received.pt")
        return
    sharding.shard_policy(net, trainers, torch.device("cpu"), [], bf16=False)
    source = ShardedWeightSource(
        net, weights if rank == 0 else None, src=0, me=rank, bucket_bytes=bucket_bytes, timeout=90,
        wire_dtype=torch.bfloat16, senders=[0, 1], sender_group=dist.group.WORLD, receivers=[2],
    )  # fmt: skip
    assert source._ring_bytes(range(len(source.bucket_sizes))) < 2 * (8 << 20)  # one piece: each cast reuses it
    source.broadcast(1)
    save_full_weights(net, rank, f"{out}/trainer.pt")


def test_a_bf16_sync_whose_casts_reuse_the_cast_ring_arrives_whole(tmp_path):
    assert run_ranks(_send_through_the_ring, 3, str(tmp_path), timeout_s=120) == [0] * 3
    full, received = torch.load(tmp_path / "trainer.pt"), torch.load(tmp_path / "received.pt")
    for key, value in full.items():
        assert torch.equal(received[key], value.to(torch.bfloat16)), key


def test_pieces_cover_every_bucket_byte_once_and_rows_follow_torch_chunk():
    net = FrozenEncoderNet(head_width=17, outputs=1)
    entries, sizes = lay_out(net, 2048)
    pieces = shard_pieces(entries, sizes, [10, 11, 12])
    for index in range(len(sizes)):
        covered = sorted((p.start, p.end) for p in pieces[index])
        used = [(e.offset, e.offset + e.nbytes) for e in entries if e.bucket == index]
        used += [(0, HEADER_BYTES)] if index == 0 else []
        assert sum(end - start for start, end in covered) == sum(end - start for start, end in used)
        assert all(a[1] <= b[0] for a, b in zip(covered, covered[1:]))  # no overlaps
    last = [p for bucket in pieces for p in bucket if p.entry is not None and p.entry.name == "head.2.weight"]
    assert [p.sender for p in last] == [10]  # 1 row over 3 trainers: the first holds it, the others none
    middle = [p for bucket in pieces for p in bucket if p.entry is not None and p.entry.name == "head.0.bias"]
    assert [(p.sender, (p.end - p.start) // 4) for p in middle] == [(10, 6), (11, 6), (12, 5)]


def _hybrid_send(rank: int, world_size: int, out: str) -> None:
    """Hybrid sharding, 2 replicas of 2 shards (ranks 0-3), one inference rank (4): the first replica sends."""
    mesh = [[0, 1], [2, 3]]
    trainers = dist.new_group([0, 1, 2, 3])
    shard_groups = [dist.new_group(ranks) for ranks in mesh]
    replicate_groups = [dist.new_group(list(column)) for column in zip(*mesh)]
    weights = dist.new_group([0, 4])
    senders = dist.new_group([0, 1, 4])
    net = FrozenEncoderNet(head_width=17, outputs=1)
    if rank == 4:
        sync = WeightSync(
            net, weights, src=0, me=4, bucket_bytes=2048, timeout=90, senders=[0, 1], sender_group=senders
        )
        assert sync.broadcast(-1) == 3
        sync.verify(3)
        torch.save({k: v.clone() for k, v in net.state_dict().items()}, f"{out}/received.pt")
        return
    hybrid = (replicate_groups[rank % 2], shard_groups[rank // 2], mesh)
    sharding.shard_policy(net, trainers, torch.device("cpu"), [], bf16=False, hybrid=hybrid)
    optimizer = torch.optim.Adam([p for p in net.parameters() if p.requires_grad], lr=0.01)
    torch.manual_seed(rank)
    net(torch.randn(5, 6)).square().sum().backward()
    optimizer.step()
    source = ShardedWeightSource(
        net, weights if rank == 0 else None, src=0, me=rank, bucket_bytes=2048, timeout=90,
        senders=[0, 1], sender_group=senders, receivers=[4],
    )  # fmt: skip
    source.broadcast(3)
    source.verify(3)
    save_full_weights(net, rank, f"{out}/trainer.pt")


def test_with_hybrid_sharding_the_first_replica_sends(tmp_path):
    import torch.optim  # noqa: F401 - imported by the parent so the forked ranks need not

    assert run_ranks(_hybrid_send, 5, str(tmp_path), timeout_s=120) == [0] * 5
    full, received = torch.load(tmp_path / "trainer.pt"), torch.load(tmp_path / "received.pt")
    assert sorted(full) == sorted(received)
    for key, value in full.items():
        assert torch.equal(received[key], value), key
