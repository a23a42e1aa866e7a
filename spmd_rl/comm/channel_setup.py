"""Opening channels between ranks (`open_channels`): every channel's layout agreed with its peer at start-up,
before the first message, and the tags that keep channels apart.

Tags. Channels between the same two ranks must not share a tag, or one channel's receive could match another's
message. Each channel name owns three tags, derived from the name alone so both ends agree without talking:
    data    = tag_base + 4 * (crc32(name) mod 2**20)
    layout  = data + 1   (sender -> receiver: the layout's length and digest, then its encoded bytes)
    verdict = data + 2   (receiver -> sender: 0 accepted, 1 rejected)
A rank that would use one tag for two names with the same peer fails at setup, naming both (rename one).
Tags separate channels only on gloo; NCCL ignores tags and matches point-to-point operations in the order they
are posted, so channels carrying CUDA buffers must be used in the same order on both ends.
"""

from __future__ import annotations

import datetime
import zlib
from collections.abc import Callable, Iterable, Sequence

import torch
import torch.distributed as dist
from tensordict import TensorDictBase

from spmd_rl.comm.channel import RecvChannel, SendChannel, TensorLayout, as_timedelta, plain_rank
from spmd_rl.runtime.distributed import Peer, comm_error, wait


def channel_tags(name: str, tag_base: int = 0) -> tuple[int, int, int]:
    """(data, layout, verdict) tags of the channel called name; see the module docstring."""
    data = tag_base + 4 * (zlib.crc32(name.encode()) % (1 << 20))
    return data, data + 1, data + 2


def _check_tags(ends: Iterable[tuple[int, str]], direction: str, tag_base: int) -> None:
    seen: dict[tuple[int, int], str] = {}
    for peer, name in ends:
        tag = channel_tags(name, tag_base)[0]
        if (peer, tag) in seen:
            other = seen[(peer, tag)]
            raise ValueError(
                f"two channels {direction} rank {peer} named {other!r} and {name!r}: "
                + ("give them different names" if other == name else "their tags collide; rename one")
            )
        seen[(peer, tag)] = name


def open_channels(
    sends: Sequence[tuple[int, str, TensorDictBase]],
    recvs: Sequence[tuple[int, str, TensorLayout | TensorDictBase | None]],
    me: int,
    timeout: datetime.timedelta | float,
    describe_rank: Callable[[int], str] = plain_rank,
    group=None,
    device: torch.device | str = "cpu",
    tag_base: int = 0,
    num_recv_buffers: int = 1,
) -> tuple[list[SendChannel], list[RecvChannel]]:
    """Agree on every channel's layout with its peer and return the channels, in the order asked for.

    sends: (peer, name, example TensorDict); recvs: (peer, name, expected layout, example, or None to accept the
    sender's). Every rank posts all its handshake messages before it waits on any, so the order in which ranks
    (or a rank's channels) are listed cannot deadlock. A receiver whose expected layout differs from the sender's
    raises a ValueError naming both ranks and the difference, and tells the sender, which raises too.
    The handshake travels as CPU tensors (gloo); `device` only places the channels' buffers.
    """
    timeout = as_timedelta(timeout)
    _check_tags(((peer, name) for peer, name, _ in sends), "to", tag_base)
    _check_tags(((peer, name) for peer, name, _ in recvs), "from", tag_base)
    handshake = _Handshake(me, timeout, describe_rank, group, tag_base)
    # Post everything that does not depend on a peer: our layouts out, their headers and verdicts in.
    verdicts_in = handshake.send_layouts(sends)
    headers_in = handshake.post_header_receives(recvs)
    recv_layouts, problems = handshake.judge_layouts(recvs, headers_in)
    problems += handshake.read_verdicts(sends, verdicts_in)
    handshake.finish_sends()
    if problems:
        raise ValueError("; ".join(problems))

    def end(kind, peer: int, name: str, layout: TensorLayout, *options):
        tag = channel_tags(name, tag_base)[0]
        return kind(layout, me, peer, name, tag, timeout, describe_rank, group, device, *options)

    send_channels = [end(SendChannel, peer, name, TensorLayout.of(example)) for peer, name, example in sends]
    recv_channels = [
        end(RecvChannel, peer, name, layout, num_recv_buffers) for (peer, name, _), layout in zip(recvs, recv_layouts)
    ]
    return send_channels, recv_channels


class _Handshake:
    """One rank's layout handshake over all its channels (open_channels): senders send their layout and learn the
    receiver's verdict; receivers judge each layout against what they expect."""

    def __init__(self, me: int, timeout: datetime.timedelta, describe_rank: Callable[[int], str], group, tag_base: int):
        self.me, self.timeout, self.describe_rank = me, timeout, describe_rank
        self.group, self.tag_base = group, tag_base
        self.outgoing: list = []  # (work, tensor, peer, describe) of every send, finished last

    def what(self, peer_from: int, peer_to: int, name: str, step: str) -> Callable[[], str]:
        return lambda: (
            f"{self.describe_rank(self.me)}: layout handshake ({step}) of channel {name!r} from "
            f"{self.describe_rank(peer_from)} to {self.describe_rank(peer_to)}"
        )

    def post(self, operation, tensor: torch.Tensor, peer: int, tag: int, describe: Callable[[], str]):
        """dist.isend or dist.irecv; a peer already gone can fail the post itself."""
        try:
            return operation(tensor, peer, group=self.group, tag=tag)
        except RuntimeError as exc:
            raise comm_error(describe(), exc, self.timeout, Peer(self.describe_rank(peer), (peer,))) from exc

    def finish(self, work, peer: int, describe: Callable[[], str]) -> None:
        wait(work, self.timeout, describe, Peer(self.describe_rank(peer), (peer,)))

    def send_layouts(self, sends) -> list:
        """Each send channel's layout out (a header, then the encoded layout) and its verdict's receive posted."""
        verdicts_in = []
        for peer, name, example in sends:
            layout = TensorLayout.of(example)
            _, layout_tag, verdict_tag = channel_tags(name, self.tag_base)
            encoded = torch.frombuffer(bytearray(layout.encode()), dtype=torch.uint8)
            header = torch.tensor([encoded.numel(), layout.digest], dtype=torch.int64)
            for tensor in (header, encoded):  # same tag, same peer: they arrive in this order
                describe = self.what(self.me, peer, name, "send layout")
                self.outgoing.append(
                    (self.post(dist.isend, tensor, peer, layout_tag, describe), tensor, peer, describe)
                )
            verdict = torch.zeros(1, dtype=torch.int64)
            verdicts_in.append(
                (
                    self.post(
                        dist.irecv, verdict, peer, verdict_tag, self.what(peer, self.me, name, "receive verdict")
                    ),
                    verdict,
                    layout,
                )
            )
        return verdicts_in

    def post_header_receives(self, recvs) -> list:
        headers_in = []
        for peer, name, _ in recvs:
            header = torch.zeros(2, dtype=torch.int64)
            headers_in.append(
                (
                    self.post(
                        dist.irecv,
                        header,
                        peer,
                        channel_tags(name, self.tag_base)[1],
                        self.what(peer, self.me, name, "receive length"),
                    ),
                    header,
                )
            )
        return headers_in

    def judge_layouts(self, recvs, headers_in) -> tuple[list[TensorLayout], list[str]]:
        """Receive each sender's layout, judge it against what this rank expected, send the verdict back."""
        me, describe_rank = self.me, self.describe_rank
        bodies_in = []
        for (peer, name, _), (work, header) in zip(recvs, headers_in):
            self.finish(work, peer, self.what(peer, me, name, "receive length"))
            body = torch.zeros(int(header[0]), dtype=torch.uint8)
            bodies_in.append(
                (
                    self.post(
                        dist.irecv,
                        body,
                        peer,
                        channel_tags(name, self.tag_base)[1],
                        self.what(peer, me, name, "receive layout"),
                    ),
                    body,
                )
            )
        recv_layouts, problems = [], []
        for (peer, name, expected), (work, body) in zip(recvs, bodies_in):
            self.finish(work, peer, self.what(peer, me, name, "receive layout"))
            theirs = TensorLayout.decode(body.numpy().tobytes())
            if isinstance(expected, TensorDictBase):
                expected = TensorLayout.of(expected)
            difference = "" if expected is None else theirs.difference(expected, "sender", "receiver")
            if difference:
                problems.append(
                    f"channel {name!r} from {describe_rank(peer)} to {describe_rank(me)}: the sender's "
                    f"layout differs from the receiver's (sender vs receiver): {difference}"
                )
            recv_layouts.append(theirs)
            verdict = torch.tensor([1 if difference else 0], dtype=torch.int64)
            describe = self.what(me, peer, name, "send verdict")
            self.outgoing.append(
                (
                    self.post(dist.isend, verdict, peer, channel_tags(name, self.tag_base)[2], describe),
                    verdict,
                    peer,
                    describe,
                )
            )
        return recv_layouts, problems

    def read_verdicts(self, sends, verdicts_in) -> list[str]:
        problems = []
        for (peer, name, _), (work, verdict, layout) in zip(sends, verdicts_in):
            self.finish(work, peer, self.what(peer, self.me, name, "receive verdict"))
            if int(verdict[0]) != 0:
                problems.append(
                    f"channel {name!r} from {self.describe_rank(self.me)} to {self.describe_rank(peer)}: "
                    f"the receiver rejected the sender's layout {layout.describe()} (its error names the "
                    f"difference)"
                )
        return problems

    def finish_sends(self) -> None:
        for work, _tensor, peer, describe in self.outgoing:
            self.finish(work, peer, describe)
