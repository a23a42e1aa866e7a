"""Channels: layouts, point-to-point round trips over real gloo ranks, and the in-process channel."""

import datetime

import pytest
import torch
import torch.distributed as dist
from harness.multiproc import assert_all_ok, run_ranks
from tensordict import TensorDict

from spmd_rl.comm.channel import HEADER_BYTES, RecvChannel, SendChannel, TensorLayout
from spmd_rl.comm.channel_setup import channel_tags, open_channels
from spmd_rl.comm.flat import ALIGNMENT
from spmd_rl.comm.local_channel import local_channel
from spmd_rl.runtime.errors import CommError

TIMEOUT = datetime.timedelta(seconds=20)


def make_message(seed: int) -> TensorDict:
    """A nested TensorDict with every dtype the framework sends; its contents depend on seed."""
    g = torch.Generator().manual_seed(seed)
    rollout = TensorDict(
        {
            "obs": torch.randn(5, 3, 4, generator=g),
            "reward": torch.randn(5, 3, generator=g, dtype=torch.float64),
            "action": torch.randint(-1000, 1000, (5, 3), generator=g),
            "done": torch.rand(5, 3, generator=g) > 0.5,
            "pixels": torch.randint(0, 256, (5, 3, 2, 2), generator=g, dtype=torch.uint8),
        },
        batch_size=[5, 3],
    )
    return TensorDict(
        {
            "rollout": rollout,
            "version": torch.randint(0, 1 << 30, (1,), generator=g, dtype=torch.int32),
            "scalar": torch.randn((), generator=g),
            "empty": torch.zeros(0, 7),
        },
        batch_size=[],
    )


def assert_same(a: TensorDict, b: TensorDict) -> None:
    assert TensorLayout.of(a) == TensorLayout.of(b)
    for key in a.keys(include_nested=True, leaves_only=True):
        assert torch.equal(a.get(key), b.get(key)), key


def describe(rank: int) -> str:
    return f"rank {rank} ({['env', 'inference', 'trainer'][rank]} 0)"


def open_between(me: int, sends: list, recvs: list, **options):
    """open_channels as rank `me` of these tests: TIMEOUT for every wait, ranks named by describe."""
    return open_channels(sends=sends, recvs=recvs, me=me, timeout=TIMEOUT, describe_rank=describe, **options)


# --- layout and local, single process ----------------------------------------------------------------------------


def test_layout_is_canonical_and_allocates_aligned_views():
    example = make_message(0)
    layout = TensorLayout.of(example)
    assert TensorLayout.decode(layout.encode()) == layout
    assert TensorLayout.of(make_message(1)).digest == layout.digest  # contents do not matter, layout does
    assert layout.describe().startswith("{empty: float32[0, 7]")  # keys in sorted order
    flat, views = layout.allocate()
    assert flat.numel() == layout.nbytes >= HEADER_BYTES + sum(leaf.nbytes for leaf in layout.leaves)
    assert views["rollout"].batch_size == torch.Size([5, 3])
    for offset in layout.offsets:
        assert offset % ALIGNMENT == 0 and offset >= HEADER_BYTES
    for (key, view), offset in zip(((leaf.key, views.get(leaf.key)) for leaf in layout.leaves), layout.offsets):
        assert view.numel() == 0 or view.data_ptr() == flat.data_ptr() + offset, key  # a view into the buffer
    views.update_(example)
    assert_same(views, example)


def test_layout_difference_names_the_key():
    other = make_message(0)
    other["rollout", "obs"] = torch.zeros(5, 3, 8)
    del other["scalar"]
    difference = TensorLayout.of(make_message(0)).difference(TensorLayout.of(other))
    assert "rollout.obs: float32[5, 3, 4] vs rollout.obs: float32[5, 3, 8]" in difference
    assert "'scalar' only in the first" in difference


def test_wrong_message_at_send_is_a_value_error_naming_channel_ranks_and_key():
    channel = SendChannel(
        TensorLayout.of(make_message(0)), me=0, peer=1, name="segments", tag=0, timeout=TIMEOUT, describe_rank=describe
    )
    wrong_dtype = make_message(0)
    wrong_dtype["rollout", "action"] = wrong_dtype["rollout", "action"].int()
    missing = make_message(0).exclude("scalar")
    extra = make_message(0).set("bonus", torch.zeros(1))
    for bad, key in ((wrong_dtype, "rollout.action"), (missing, "scalar"), (extra, "bonus")):
        with pytest.raises(ValueError) as error:
            channel.isend(bad)
        message = str(error.value)
        assert "'segments'" in message and "rank 0 (env 0)" in message and "rank 1 (inference 0)" in message
        assert key in message


def test_duplicate_channel_names_to_one_peer_are_rejected_before_any_communication():
    with pytest.raises(ValueError, match="'obs' and 'obs'"):
        open_channels(sends=[(1, "obs", make_message(0)), (1, "obs", make_message(0))], recvs=[], me=0, timeout=TIMEOUT)
    data, layout, verdict = channel_tags("obs", tag_base=100)
    assert data >= 100 and (layout, verdict) == (data + 1, data + 2)


def test_local_channel_hands_over_by_reference_in_order():
    send, recv = local_channel("actions", make_message(0))
    messages = [make_message(i) for i in range(3)]
    handles = [send.isend(m) for m in messages]
    for handle in handles:
        handle.wait()
    pending = recv.irecv()
    assert pending.wait() is messages[0]  # no copy
    assert recv.recv() is messages[1] and recv.recv() is messages[2]  # FIFO
    with pytest.raises(RuntimeError, match="receive with no message sent"):
        recv.recv()
    with pytest.raises(RuntimeError, match="receive with no message sent"):
        recv.irecv().wait()


def test_local_channel_buffer_and_layout_checks():
    send, recv = local_channel("obs", make_message(0))
    send.buffer.update_(make_message(4))
    send.send()
    with pytest.raises(RuntimeError, match="sent again before the receiver took"):
        send.send()  # would overwrite the unread message
    assert recv.recv() is send.buffer
    assert_same(send.buffer, make_message(4))
    with pytest.raises(ValueError, match="local channel 'obs'.*rollout.obs"):
        send.send(make_message(0).set(("rollout", "obs"), torch.zeros(5, 3, 4, dtype=torch.float64)))


# --- between ranks ------------------------------------------------------------------------------------------------


def _round_trips(rank, world_size):
    # rank 0 sends 100 messages to rank 1 (half written in place, half copied from a TensorDict); rank 1 reads
    # them double-buffered and echoes each one back through its own send buffer; two more fill both buffers.
    example = make_message(0)
    if rank == 0:
        (out,), (back,) = open_between(0, sends=[(1, "segments", example)], recvs=[(1, "echo", example)])
        for i in range(102):
            if i % 2:
                out.buffer.update_(make_message(i))
                out.isend()
            else:
                out.isend(make_message(i))
            if i < 100:
                assert_same(back.recv(), make_message(i))
        out.wait()
    else:
        (echo,), (inbox,) = open_between(
            1, sends=[(0, "echo", example)], recvs=[(0, "segments", None)], num_recv_buffers=2
        )
        pending = inbox.irecv()
        for i in range(100):
            message = pending.wait()
            if i < 99:
                pending = inbox.irecv()  # the next receive lands in the other buffer
            assert_same(message, make_message(i))
            echo.buffer.update_(message)
            echo.isend()
        echo.wait()
        last = [inbox.irecv(), inbox.irecv()]
        with pytest.raises(RuntimeError, match="one per buffer"):
            inbox.irecv()  # a third would overwrite a buffer whose receive is pending
        for i, handle in zip((100, 101), last):
            assert_same(handle.wait(), make_message(i))


def test_round_trip_of_100_nested_messages_in_order_double_buffered():
    assert_all_ok(run_ranks(_round_trips, 2, timeout_s=30))


def _layout_mismatch(rank, world_size):
    sent, expected = make_message(0), make_message(0)
    expected["rollout", "obs"] = torch.zeros(5, 3, 6)
    with pytest.raises(ValueError) as error:
        if rank == 0:
            open_between(0, sends=[(1, "segments", sent)], recvs=[])
        else:
            open_between(1, sends=[], recvs=[(0, "segments", TensorLayout.of(expected))])
    message = str(error.value)
    assert "'segments' from rank 0 (env 0) to rank 1 (inference 0)" in message
    if rank == 1:
        assert "rollout.obs: float32[5, 3, 4] vs rollout.obs: float32[5, 3, 6]" in message
    else:
        assert "rejected" in message


def test_layout_mismatch_at_setup_fails_on_both_ends_naming_both_ranks():
    assert_all_ok(run_ranks(_layout_mismatch, 2, timeout_s=20))


def _wrong_header(rank, world_size):
    # Two ends built around different layouts of the same byte size (as a bug bypassing the handshake would):
    # the receiver's header check catches it instead of reading floats as ints.
    floats = TensorLayout.of(TensorDict({"x": torch.zeros(4)}, batch_size=[]))
    ints = TensorLayout.of(TensorDict({"x": torch.zeros(4, dtype=torch.int32)}, batch_size=[]))
    assert floats.nbytes == ints.nbytes and floats.digest != ints.digest
    if rank == 0:
        SendChannel(floats, 0, 1, "obs", tag=7, timeout=TIMEOUT, describe_rank=describe).send()
    else:
        with pytest.raises(CommError, match="rank 1 \\(inference 0\\): channel 'obs' from rank 0 \\(env 0\\)"):
            RecvChannel(ints, 1, 0, "obs", tag=7, timeout=TIMEOUT, describe_rank=describe).recv()
    dist.barrier()


def test_receiver_rejects_a_message_with_another_layout_digest():
    assert_all_ok(run_ranks(_wrong_header, 2, timeout_s=20))


def _out_of_order(rank, world_size):
    # A message whose sequence number is not the one the receiver expects (one lost, or another sender on the
    # channel's tag): the receiver names both numbers in one line instead of handing the bytes on.
    layout = TensorLayout.of(TensorDict({"x": torch.zeros(4)}, batch_size=[]))
    if rank == 0:
        flat = torch.zeros(layout.nbytes, dtype=torch.uint8)
        flat[:HEADER_BYTES].view(torch.int64).copy_(torch.tensor([2, layout.digest]))  # message 2 comes first
        dist.send(flat, dst=1, tag=7)
    else:
        expected = (
            f"channel 'obs' from rank 0 \\(env 0\\) expected message 1 with layout digest {layout.digest}, "
            "got message 2"
        )
        with pytest.raises(CommError, match=expected):
            RecvChannel(layout, 1, 0, "obs", tag=7, timeout=TIMEOUT, describe_rank=describe).recv()
    dist.barrier()


def test_receiver_rejects_a_message_out_of_sequence():
    assert_all_ok(run_ranks(_out_of_order, 2, timeout_s=20))
