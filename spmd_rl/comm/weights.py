"""Weight broadcast: the trainer's parameters and buffers, flattened into fixed buckets, to every inference rank.

WeightSync lays a module's parameters AND buffers (normalizer statistics are model state; buffers may be float64
or integer) into flat byte buckets of at most bucket_bytes each (a tensor larger than that gets a bucket of its
own), every tensor at an aligned offset, whatever its dtype. It then points the module's tensors at views into
the buckets (`param.data = view`, buffers replaced by their views), so a broadcast needs no copy on either side:
the source broadcasts the buckets its optimizer has been updating in place, and receivers' modules read the
buckets they received into.

Build it:
- after the module is on its final device (`module.to()` would allocate new tensors and detach the views), and
- before DDP and torch.compile, which capture the tensors they see at construction. (Optimizers hold the
  Parameter objects, whose .data we swap, so they may exist already; building first is simply the safe order.)
A tensor that is later replaced rather than updated in place (`self.mean = new`, `load_state_dict(assign=True)`)
is not lost: the source copies it into its bucket before each broadcast, every member before each verify, and
the module is pointed back at the bucket.

Bucket 0 starts with a 16-byte header: the policy version and the layout digest (int64 each), so the version
travels inside the first bucket instead of costing a collective of its own.

Over 400 lines: the bucket layout, its digest, the checksums and the receiving WeightSync are one protocol that
every member of the weight group computes alike; the trainers' other sources are in weight_sources.py.
"""

from __future__ import annotations

import datetime
import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from spmd_rl.comm.flat import aligned
from spmd_rl.runtime.distributed import Peer, comm_error, wait

HEADER_BYTES = 16  # int64 version, int64 layout digest, at the front of bucket 0
CHECKSUM_CHUNK = 1 << 20  # int32 words per checksum step: bounds the temporary int64 copies to 8 MB
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)  # 2**64 / golden ratio, as a signed int64: spreads position weights


class WeightMismatchError(RuntimeError):
    """Members of the weight group hold different weights (or different models)."""


def plain_rank(rank: int) -> str:
    return f"rank {rank}"


@dataclass
class _Entry:
    """One parameter or buffer and where it lives in the buckets."""

    name: str
    owner: nn.Module  # the submodule whose _parameters / _buffers hold it
    attr: str
    is_param: bool
    bucket: int
    offset: int  # bytes into the bucket
    shape: tuple[int, ...] = ()  # the full tensor's (a sharded parameter's global shape)
    dtype: torch.dtype = torch.float32  # on the wire
    frozen: bool = False  # a parameter without requires_grad: sent with the first broadcast only
    view: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * element_size(self.dtype)

    def current(self) -> torch.Tensor:
        tensor = (self.owner._parameters if self.is_param else self.owner._buffers)[self.attr]
        assert tensor is not None  # lay_out took the module's tensors, never an empty slot
        return tensor

    def bucket_view(self) -> torch.Tensor:
        """view, which WeightSync sets when it lays out its buckets (before any other use)."""
        assert self.view is not None
        return self.view

    def point_at_view(self) -> None:
        if self.is_param:
            self.current().data = self.bucket_view()
        else:
            self.owner._buffers[self.attr] = self.bucket_view()


def element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def lay_out(module: nn.Module, bucket_bytes: int, wire_dtype: torch.dtype | None = None) -> tuple[list, list[int]]:
    """(entries, bucket sizes in bytes): where each of the module's parameters and buffers lies in the buckets.

    Every member computes the same layout from the same architecture: tensors in module order (parameters, then
    buffers; frozen parameters last, in buckets of their own so that later broadcasts can leave them out), packed
    into byte buckets at aligned offsets. Dtypes share buckets (a broadcast moves bytes), so a float32 policy with
    float64 normalizer statistics and an int64 counter is one collective, not three. wire_dtype: the dtype
    floating-point parameters travel in (None: their own). Sharded parameters count with their global shape."""
    named: list[tuple[str, bool, torch.Tensor]] = [(name, True, p) for name, p in module.named_parameters()]
    named += [(name, False, b) for name, b in module.named_buffers() if b is not None]
    if not named:
        raise ValueError("WeightSync: the module has no parameters or buffers to broadcast")
    named.sort(key=lambda item: item[1] and not item[2].requires_grad)  # stable: frozen parameters last
    devices = {t.device for *_, t in named}
    if len(devices) != 1:
        raise ValueError(
            f"WeightSync: the module's tensors are on several devices {sorted(map(str, devices))}; "
            f"move it to one device first"
        )
    entries: list[_Entry] = []
    sizes: list[int] = []
    used = start = 0  # bytes used in the open bucket, and where its data starts
    for name, is_param, tensor in named:
        owner_name, _, attr = name.rpartition(".")
        frozen = is_param and not tensor.requires_grad
        dtype = wire_dtype if wire_dtype is not None and is_param and tensor.is_floating_point() else tensor.dtype
        entry = _Entry(name, module.get_submodule(owner_name), attr, is_param, 0, 0, tuple(tensor.shape), dtype, frozen)
        first_frozen = frozen and not (entries and entries[-1].frozen)
        if not sizes or (used > start and (first_frozen or aligned(used) + entry.nbytes > bucket_bytes)):
            used = start = 0 if sizes else HEADER_BYTES
            sizes.append(used)
        entry.bucket, entry.offset = len(sizes) - 1, aligned(used)
        entries.append(entry)
        used = sizes[-1] = entry.offset + entry.nbytes
    return entries, [aligned(size) for size in sizes]


def bucket_checksum(data: torch.Tensor) -> int:
    """A position-sensitive checksum of a byte tensor whose size is a multiple of 4, exact for bit equality.

    Sum over int32 words w[i] of w[i] * k[i] mod 2**64, with k[i] = (i * golden) | 1 odd: changing any single
    word always changes the sum (an odd k is invertible mod 2**64); words that trade places change it unless
    (w[a] - w[b]) * (k[a] - k[b]) happens to be a multiple of 2**64.
    """
    words = data.view(torch.int32)
    total = torch.zeros((), dtype=torch.int64, device=data.device)
    for start in range(0, words.numel(), CHECKSUM_CHUNK):
        chunk = words[start : start + CHECKSUM_CHUNK].to(torch.int64)
        position = torch.arange(start, start + chunk.numel(), dtype=torch.int64, device=data.device)
        total += chunk.mul_(position.mul_(_GOLDEN).bitwise_or_(1)).sum()
    return int(total)


@dataclass
class Piece:
    """A byte range of a bucket that one trainer sends to every receiver: its rows of a sharded parameter, or
    (from the first trainer) a whole buffer, or bucket 0's header (entry None)."""

    sender: int  # global rank
    start: int
    end: int
    entry: _Entry | None


def shard_pieces(entries: list[_Entry], bucket_sizes: list[int], senders: list[int]) -> list[list[Piece]]:
    """Per bucket, the pieces the senders send, in the order they are sent and received. Every member computes them
    from the layout alone: FSDP2 shards every parameter on dim 0 in torch.chunk's way (sender k holds rows
    [k*c, (k+1)*c) of the d0, c = ceil(d0 / len(senders)), the last ones fewer or none), and rows are contiguous
    bytes of the whole tensor, so each sender's rows land at their place in the bucket with no reassembly.
    Buffers are not sharded: the first sender sends them whole, with bucket 0's header."""
    pieces: list[list[Piece]] = [[] for _ in bucket_sizes]
    pieces[0].append(Piece(senders[0], 0, HEADER_BYTES, None))
    for entry in entries:
        if not entry.is_param or not entry.shape:
            pieces[entry.bucket].append(Piece(senders[0], entry.offset, entry.offset + entry.nbytes, entry))
            continue
        rows = entry.shape[0]
        row_bytes = entry.nbytes // rows if rows else 0
        chunk = -(-rows // len(senders))
        for k, sender in enumerate(senders):
            first, last = min(rows, k * chunk), min(rows, (k + 1) * chunk)
            if last > first:
                start = entry.offset + first * row_bytes
                pieces[entry.bucket].append(Piece(sender, start, start + (last - first) * row_bytes, entry))
    return pieces


class WeightGroupMember:
    """What every member of the weight group shares: the bucket layout, its digest, the layout check at start and
    the checksum verify. Subclasses hold the bytes: WeightSync in buckets the module's tensors are views of,
    GatheredWeightSource in one bucket-sized buffer it fills from the trainers' shards."""

    entries: list[_Entry]
    bucket_sizes: list[int]
    broadcasts: int
    device: torch.device  # these two: set by the subclass once its layout is known
    digest: int

    def _join(self, group, src: int, me: int, timeout, describe_rank) -> None:
        self.group, self.src, self.me, self.describe_rank = group, src, me, describe_rank
        self.timeout = timeout if isinstance(timeout, datetime.timedelta) else datetime.timedelta(seconds=timeout)
        self.members = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
        if me not in self.members or src not in self.members:
            who = describe_rank(me) if me not in self.members else f"the source {describe_rank(src)}"
            raise ValueError(
                f"WeightSync: {who} is not a member of the weight group {self.members}; only members "
                f"may take part in weight broadcasts"
            )

    def _digest(self, bucket_bytes: int) -> int:
        text = repr([(e.name, e.shape, str(e.dtype), e.bucket, e.offset) for e in self.entries])
        return int.from_bytes(hashlib.sha256(f"{bucket_bytes}:{text}".encode()).digest()[:8], "little", signed=True)

    @property
    def live_buckets(self) -> int:
        """Buckets before the first that holds only frozen parameters: what every broadcast after the first sends."""
        frozen = [e.bucket for e in self.entries if e.frozen]
        return min(frozen) if frozen else len(self.bucket_sizes)

    def buckets_to_send(self) -> range:
        """The buckets of the next broadcast: all of them the first time, then those with trainable weights or
        buffers (frozen parameters are sent once per process: at start and after a resume)."""
        return range(len(self.bucket_sizes) if self.broadcasts == 0 else self.live_buckets)

    def describe_bucket(self, index: int) -> str:
        names = [e.name for e in self.entries if e.bucket == index]
        shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        return f"bucket {index} ({self.bucket_sizes[index]} bytes: {shown})"

    def _all_gather(self, values: list[int], what: str) -> list[list[int]]:
        """values from every member, in the order of self.members."""
        mine = torch.tensor(values, dtype=torch.int64, device=self.device)
        gathered = [torch.empty_like(mine) for _ in self.members]
        others = tuple(rank for rank in self.members if rank != self.me)
        peer = Peer(self.describe_rank(others[0]) if len(others) == 1 else f"one of ranks {list(others)}", others)

        def describe() -> str:
            return f"{self.describe_rank(self.me)}: {what} (all_gather over the weight group {self.members})"

        try:
            work = dist.all_gather(gathered, mine, group=self.group, async_op=True)
        except RuntimeError as exc:  # a member already gone can fail the post itself
            raise comm_error(describe(), exc, self.timeout, peer) from exc
        wait(work, self.timeout, describe, peer)
        return [t.tolist() for t in gathered]

    def _check_same_models(self) -> None:
        gathered = self._all_gather([self.digest, len(self.entries), sum(self.bucket_sizes)], "weight layout check")
        source = gathered[self.members.index(self.src)]
        differing = [
            f"{self.describe_rank(rank)} ({count} tensors, {nbytes} bytes)"
            for rank, (digest, count, nbytes) in zip(self.members, gathered)
            if digest != source[0]
        ]
        if differing:
            raise WeightMismatchError(
                f"the weight layout (parameter and buffer names, shapes, dtypes, weights.bucket_mb, "
                f"inference.dtype) of {', '.join(differing)} differs from the source "
                f"{self.describe_rank(self.src)} ({source[1]} tensors, {source[2]} bytes): every member must "
                f"build the same model with the same config"
            )

    def broadcast_peer(self) -> Peer:
        if self.me != self.src:
            senders = tuple(getattr(self, "senders", None) or (self.src,))
            if len(senders) > 1:
                return Peer(f"one of the trainers {list(senders)}", senders)
            return Peer(self.describe_rank(self.src), (self.src,))
        receivers = tuple(rank for rank in self.members if rank != self.src)
        return Peer(
            self.describe_rank(receivers[0]) if len(receivers) == 1 else f"one of ranks {list(receivers)}", receivers
        )

    def _describe_broadcast(self, index: int, count: int, version: int | None) -> str:
        return (
            f"{self.describe_rank(self.me)}: weight broadcast from {self.describe_rank(self.src)} (bucket "
            f"{index + 1} of {count}{f', version {version}' if version is not None else ''})"
        )

    def _check_digest(self, digest: int) -> None:
        if digest != self.digest:
            raise WeightMismatchError(
                f"{self.describe_rank(self.me)}: weights from {self.describe_rank(self.src)} "
                f"carry layout digest {digest}, this rank's is {self.digest}"
            )

    def checksums(self) -> list[int]:
        raise NotImplementedError

    def held_version(self) -> int:
        raise NotImplementedError

    def verify(self, version: int) -> None:
        """Check that every member holds the source's weights of this version, bit for bit.

        Collective over the group; call it where the source has not changed its weights since broadcast(version)
        (e.g. right after it). On any mismatch every member raises the same WeightMismatchError naming the ranks,
        the buckets and the version.
        """
        gathered = self._all_gather(
            [version, self.held_version()] + self.checksums(), f"weight verify of version {version}"
        )
        source = gathered[self.members.index(self.src)]
        problems = []  # built from the gathered values only, so every member raises the same message
        if source[1] != source[0]:
            problems.append(
                f"the source {self.describe_rank(self.src)} holds version {source[1]}, not the "
                f"version {source[0]} being verified"
            )
        for rank, (asked, held, *sums) in zip(self.members, gathered):
            if asked != source[0]:
                problems.append(f"{self.describe_rank(rank)} verifies version {asked}, the source {source[0]}")
            if held != source[1]:
                problems.append(f"{self.describe_rank(rank)} holds version {held}, the source {source[1]}")
            for index, (theirs, sources) in enumerate(zip(sums, source[2:])):
                if theirs != sources:
                    problems.append(
                        f"{self.describe_rank(rank)} differs from the source "
                        f"{self.describe_rank(self.src)} in {self.describe_bucket(index)} at version "
                        f"{source[0]}"
                    )
        if problems:
            raise WeightMismatchError("weight verify failed: " + "; ".join(problems))


class WeightSync(WeightGroupMember):
    """Broadcast a module's weights from src to the other members of group, and check they agree.

    Every member of the group builds one, with the same module architecture, in the same order as its other
    collectives in that group; non-members must not (a collective called by a non-member silently does nothing).
    The source may instead be a GatheredWeightSource (sharded trainers, or another dtype on the wire): it lays the
    same bytes out the same way.
    """

    def __init__(
        self,
        module: nn.Module,
        group,
        src: int,
        me: int,
        bucket_bytes: int,
        timeout: datetime.timedelta | float,
        describe_rank: Callable[[int], str] = plain_rank,
        senders: list[int] | None = None,
        sender_group=None,
    ):
        self._join(group, src, me, timeout, describe_rank)
        self.module = module
        self.entries, self.bucket_sizes = lay_out(module, bucket_bytes)
        # Sharded trainers (a ShardedWeightSource on each of `senders`, in shard order): every bucket arrives in
        # pieces, each trainer's rows straight from that trainer over sender_group, instead of one broadcast.
        self.senders = senders
        self.sender_group = sender_group
        self.pieces = shard_pieces(self.entries, self.bucket_sizes, senders) if senders else None
        self.device = self.entries[0].current().device
        self.buckets = [torch.zeros(size, dtype=torch.uint8, device=self.device) for size in self.bucket_sizes]
        for entry in self.entries:  # the module's tensors become views of the buckets
            tensor = entry.current()
            end = entry.offset + entry.nbytes
            entry.view = self.buckets[entry.bucket][entry.offset : end].view(tensor.dtype).view(tensor.shape)
            entry.view.copy_(tensor.detach())
            entry.point_at_view()
        self.digest = self._digest(bucket_bytes)
        header = self.buckets[0][:HEADER_BYTES].view(torch.int64)
        self._header = header.numpy() if header.device.type == "cpu" else header  # numpy: cheap element writes
        self._header[0] = -1  # no version received yet
        self._header[1] = self.digest
        self.broadcasts = 0  # made (source) or received so far: the first one carries the frozen parameters
        self._check_same_models()

    def _data(self, index: int) -> torch.Tensor:
        """Bucket index without the header: the bytes the checksum covers."""
        return self.buckets[index][HEADER_BYTES:] if index == 0 else self.buckets[index]

    def _adopt_module_tensors(self) -> None:
        """Copy any tensor the module replaced (instead of updating in place) into its bucket; re-point it."""
        for entry in self.entries:
            current, view = entry.current(), entry.bucket_view()
            if current.data_ptr() != view.data_ptr():
                view.copy_(current.detach())
                entry.point_at_view()

    def point_module_at_buckets(self) -> None:
        """After new bytes arrived: a module that replaced a tensor is pointed back at its bucket."""
        for entry in self.entries:
            if entry.current().data_ptr() != entry.bucket_view().data_ptr():
                entry.point_at_view()

    def broadcast(self, version: int) -> int:
        """Source: send the module's weights with this version. Receivers: load them; returns the version.

        Every member calls it at the same point of its schedule; receivers' version argument is ignored.
        """
        is_source = self.me == self.src
        if is_source:
            self._adopt_module_tensors()
            self._header[0] = version
        peer, indices = self.broadcast_peer(), self.buckets_to_send()
        works = []
        for index in indices:
            describe = self._describe_broadcast(index, len(indices), version if is_source else None)
            try:
                works.append(self.post_receive(index, self.buckets[index]))
            except RuntimeError as exc:  # a member already gone can fail the post itself
                raise comm_error(describe, exc, self.timeout, peer) from exc
        for index, bucket_works in zip(indices, works):
            describe = self._describe_broadcast(index, len(indices), version if is_source else None)
            for work in bucket_works:
                wait(work, self.timeout, lambda describe=describe: describe, peer)
        self.broadcasts += 1
        received_version, digest = self._header.tolist()
        self._check_digest(digest)
        if not is_source:
            self.point_module_at_buckets()
        return received_version

    def post_receive(self, index: int, into: torch.Tensor) -> list:
        """Post the collective(s) that bring bucket index into `into` (the source: that send it); their works. One
        broadcast from the source, or with sharded senders one receive per piece, each into its place."""
        if self.pieces is None:
            return [dist.broadcast(into, src=self.src, group=self.group, async_op=True)]
        return [
            dist.irecv(into[piece.start : piece.end], src=piece.sender, group=self.sender_group)
            for piece in self.pieces[index]
        ]

    def held_version(self) -> int:
        return int(self._header[0])

    def checksums(self) -> list[int]:
        return [bucket_checksum(self._data(index)) for index in range(self.live_buckets)]

    def verify(self, version: int) -> None:
        self._adopt_module_tensors()
        super().verify(version)
