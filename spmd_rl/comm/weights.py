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
"""

from __future__ import annotations

import collections
import datetime
import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from spmd_rl.comm.flat import aligned
from spmd_rl.comm.sharding import is_dtensor
from spmd_rl.runtime.distributed import Peer, comm_error, wait

HEADER_BYTES = 16  # int64 version, int64 layout digest, at the front of bucket 0
CHECKSUM_CHUNK = 1 << 20  # int32 words per checksum step: bounds the temporary int64 copies to 8 MB
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)  # 2**64 / golden ratio, as a signed int64: spreads position weights


class WeightMismatchError(RuntimeError):
    """Members of the weight group hold different weights (or different models)."""


def _plain_rank(rank: int) -> str:
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
        return math.prod(self.shape) * _element_size(self.dtype)

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


def _element_size(dtype: torch.dtype) -> int:
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


class _WeightGroupMember:
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


class WeightSync(_WeightGroupMember):
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
        describe_rank: Callable[[int], str] = _plain_rank,
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


def _gather_into(view: torch.Tensor, sharded) -> bool:
    """All-gather a DTensor sharded evenly on dim 0 over a 1-D mesh straight into view (the whole tensor, in
    view's dtype: each shard is cast before it travels); False for any other layout."""
    from torch.distributed.tensor import Shard

    mesh = sharded.device_mesh
    if mesh.ndim != 1 or tuple(sharded.placements) != (Shard(0),) or sharded.shape[0] % mesh.size():
        return False
    local = sharded.to_local().to(view.dtype).contiguous()
    dist.all_gather_into_tensor(view.view(-1), local.view(-1), group=mesh.get_group())
    return True


class GatheredWeightSource(_WeightGroupMember):
    """The trainers' side of a weight broadcast when the module's tensors cannot be the buckets: its parameters
    are sharded over the trainers (train.parallel=fsdp), or they travel in another dtype (inference.dtype=bf16).

    Every trainer builds one at the same point and calls broadcast()/verify() at the same points: bucket by
    bucket, every trainer all-gathers the bucket's sharded parameters (one all-gather in the trainer group per
    parameter, each shard cast to the wire dtype first) straight into a bucket-sized buffer of its own, and the
    first trainer, a member of the weight group, broadcasts its buffer. No trainer holds more than that one
    bucket beyond its shards (a parameter sharded unevenly goes through one whole temporary copy).
    Receivers are plain WeightSyncs: the layout is the same, computed from the full shapes and the wire dtype.
    """

    def __init__(
        self,
        module: nn.Module,
        group,
        src: int,
        me: int,
        bucket_bytes: int,
        timeout: datetime.timedelta | float,
        describe_rank: Callable[[int], str] = _plain_rank,
        wire_dtype: torch.dtype | None = None,
    ):
        self.is_source = me == src
        self.module = module
        self.entries, self.bucket_sizes = lay_out(module, bucket_bytes, wire_dtype)
        self.device = self.entries[0].current().device
        self.broadcasts = 0
        self.version = -1
        self._buffer: torch.Tensor | None = None  # see buffer
        if not self.is_source:  # a trainer that only contributes its shards to the gathers
            return
        self._join(group, src, me, timeout, describe_rank)
        self.digest = self._digest(bucket_bytes)
        self._check_same_models()

    @property
    def buffer(self) -> torch.Tensor:
        """One bucket on every trainer: the shards are all-gathered straight into it, in the wire dtype (made on
        first use; a ShardedWeightSource casts into part of it to send, and gathers into it only to verify).
        Uninitialized, so that only the pages used count: _fill writes every byte of a bucket it gathers."""
        if self._buffer is None:
            self._buffer = torch.empty(max(self.bucket_sizes), dtype=torch.uint8, device=self.device)
        return self._buffer

    def _fill(self, index: int, version: int) -> torch.Tensor | None:
        """Bucket index, gathered into the buffer by every trainer together; the source's to broadcast (returned),
        the others' only the output their all-gathers need (None)."""
        bucket = self.buffer[: self.bucket_sizes[index]]
        # The alignment gaps between tensors hold zeros, as every receiver's bucket does: the buffer is reused, and
        # a receiver of sent shards gets only the tensors' bytes (the checksums cover the gaps too).
        end = HEADER_BYTES if index == 0 else 0
        for entry in sorted((e for e in self.entries if e.bucket == index), key=lambda e: e.offset):
            bucket[end : entry.offset].zero_()
            end = entry.offset + entry.nbytes
        bucket[end:].zero_()
        for entry in self.entries:
            if entry.bucket != index:
                continue
            view = bucket[entry.offset : entry.offset + entry.nbytes].view(entry.dtype).view(entry.shape)
            tensor = entry.current().detach()
            if not is_dtensor(tensor):
                view.copy_(tensor)
            elif not _gather_into(view, tensor):
                view.copy_(tensor.full_tensor())  # uneven or hybrid shards: through a whole temporary copy
        if not self.is_source:
            return None
        if index == 0:
            bucket[:HEADER_BYTES].view(torch.int64).copy_(torch.tensor([version, self.digest]))
        return bucket

    def broadcast(self, version: int) -> int:
        indices = self.buckets_to_send()
        for index in indices:
            bucket = self._fill(index, version)
            if bucket is None:
                continue
            describe = self._describe_broadcast(index, len(indices), version)
            peer = self.broadcast_peer()
            try:
                work = dist.broadcast(bucket, src=self.src, group=self.group, async_op=True)
            except RuntimeError as exc:  # a member already gone can fail the post itself
                raise comm_error(describe, exc, self.timeout, peer) from exc
            wait(work, self.timeout, lambda describe=describe: describe, peer)  # the buffer is reused next
        self.broadcasts += 1
        self.version = version
        return version

    def held_version(self) -> int:
        return self.version

    def checksums(self) -> list[int]:
        sums = []
        for index in range(self.live_buckets):
            bucket = self._fill(index, self.version)
            if bucket is not None:
                sums.append(bucket_checksum(bucket[HEADER_BYTES:] if index == 0 else bucket))
        return sums

    def verify(self, version: int) -> None:
        if self.is_source:
            super().verify(version)
        else:
            self.checksums()  # the gathers the source's checksums need


def _needs_cast(entry: _Entry, rows: torch.Tensor) -> bool:
    """Whether a trainer's rows of a piece of entry go on the wire through the cast ring (another dtype, or not
    contiguous) rather than from the shard itself."""
    return rows.dtype != entry.dtype or not rows.is_contiguous()


class ShardedWeightSource(GatheredWeightSource):
    """A sharded trainer's side of a weight sync in which every trainer sends its own shards: bucket by bucket,
    each of `senders` (the trainers holding one copy of the shards, in shard order) sends its rows of the bucket's
    parameters to every inference rank, which receive them straight into their places in the bucket (WeightSync
    with the same senders; shard_pieces says what goes where). The first sender also sends the buffers and the
    header. Nothing is gathered: on the wire are only the bucket's bytes, from all trainers at once, and a trainer
    holds no copy beyond its shards but the ring that the shards cast to the wire dtype (inference.dtype) go
    through, half a bucket at most (see _send_my_pieces).
    Trainers outside `senders` (the other replicas of hybrid sharding) send nothing. verify() checks the
    receivers against the gathered buckets, as GatheredWeightSource does.
    """

    def __init__(
        self,
        module: nn.Module,
        group,
        src: int,
        me: int,
        bucket_bytes: int,
        timeout: datetime.timedelta | float,
        describe_rank: Callable[[int], str] = _plain_rank,
        wire_dtype: torch.dtype | None = None,
        *,
        senders: list[int],
        sender_group,
        receivers: list[int],
    ):
        super().__init__(module, group, src, me, bucket_bytes, timeout, describe_rank, wire_dtype)
        self.me, self.src, self.describe_rank = me, src, describe_rank  # also on trainers outside the weight group
        self.timeout = timeout if isinstance(timeout, datetime.timedelta) else datetime.timedelta(seconds=timeout)
        self.senders, self.sender_group, self.receivers = list(senders), sender_group, list(receivers)
        if src != self.senders[0]:
            raise ValueError(f"ShardedWeightSource: the source rank {src} must be the first sender {self.senders}")
        self.pieces = shard_pieces(self.entries, self.bucket_sizes, self.senders)
        if me in self.senders:
            self._check_my_rows()

    def _check_my_rows(self) -> None:
        """This trainer's shards are the rows shard_pieces says (FSDP2's dim-0 chunks); anything else cannot be
        sent piecewise, and is a framework error named here rather than a receiver's garbled weights."""
        for pieces in self.pieces:
            for piece in pieces:
                if piece.sender != self.me or piece.entry is None or not piece.entry.is_param:
                    continue
                rows = self._local_rows(piece.entry)
                if rows.numel() * _element_size(piece.entry.dtype) != piece.end - piece.start:
                    raise ValueError(
                        f"ShardedWeightSource: {self.describe_rank(self.me)} holds {tuple(rows.shape)} of "
                        f"{piece.entry.name} {piece.entry.shape}, not the dim-0 chunk the receivers expect"
                    )

    def _local_rows(self, entry: _Entry) -> torch.Tensor:
        """This trainer's own tensor for a piece of entry: its local rows of a parameter (in the training dtype),
        or a whole buffer."""
        tensor = entry.current().detach()
        if is_dtensor(tensor):
            return tensor.to_local()
        if entry.is_param and len(self.senders) > 1 and entry.shape:
            raise ValueError(f"ShardedWeightSource: parameter {entry.name} is not sharded; every parameter must be")
        return tensor

    def _ring_bytes(self, indices: range) -> int:
        """The size of the ring the pieces of this sync that need a cast are cast into: half the largest bucket
        (the sends then run while the next pieces are cast, and a trainer holds at most half a bucket beyond its
        shards), but no more than all of this sync's casts and no less than its largest; 0: nothing is cast."""
        sizes = [
            aligned(piece.end - piece.start)
            for index in indices
            for piece in self.pieces[index]
            if piece.sender == self.me
            and piece.entry is not None
            and _needs_cast(piece.entry, self._local_rows(piece.entry))
        ]
        return min(sum(sizes), max(max(sizes), max(self.bucket_sizes) // 2)) if sizes else 0

    def broadcast(self, version: int) -> int:
        if self.me in self.senders:
            self._send_my_pieces(self.buckets_to_send(), version)
        self.broadcasts += 1
        self.version = version
        return version

    def _send_my_pieces(self, indices: range, version: int) -> None:
        """Post this trainer's pieces of every bucket to every receiver, in the receivers' order, each as soon as it
        is ready, and wait for them all. A piece already in the wire dtype goes from the shard itself; one that
        needs a cast is cast into the next free part of a ring of _ring_bytes, which is reused as the oldest sends
        complete: the sends of one piece overlap the cast of the next, across bucket boundaries too, and the casts
        write into pages touched once per process rather than into fresh allocations (page faults)."""
        # Bucket 0's header piece is the source's (the first sender's) alone; only it knows the layout digest.
        header = torch.tensor([version, self.digest], dtype=torch.int64, device=self.device) if self.is_source else None
        many = len(self.receivers) > 1
        peer = Peer(
            f"one of ranks {list(self.receivers)}" if many else self.describe_rank(self.receivers[0]),
            tuple(self.receivers),
        )

        def describe(index: int) -> str:
            return (
                f"{self.describe_rank(self.me)}: sending its shards of weight bucket {index + 1} of {len(indices)} "
                f"(version {version}) to the inference ranks {self.receivers}"
            )

        ring_bytes = self._ring_bytes(indices)
        # The ring is the front of the bucket buffer verify() gathers into (never in use at once): one bucket of
        # extra memory in all, kept from sync to sync (allocating the ring afresh every sync left the allocator's
        # heap holding several of them).
        ring = self.buffer[:ring_bytes] if ring_bytes else None
        head = 0  # where the next cast goes in the ring
        # (ring start, ring end, bucket index, works), oldest first
        in_flight: collections.deque[tuple[int, int, int, list[dist.Work | None]]] = collections.deque()

        def complete_oldest() -> None:
            _, _, index, works = in_flight.popleft()
            for work in works:
                wait(work, self.timeout, lambda: describe(index), peer)

        for index in indices:
            for piece in self.pieces[index]:
                if piece.sender != self.me:
                    continue
                start = end = 0  # the ring bytes this piece holds until its sends complete (none: sent in place)
                if piece.entry is None:
                    assert header is not None  # bucket 0's header piece is the source's
                    tensor = header
                else:
                    tensor = rows = self._local_rows(piece.entry)
                    if _needs_cast(piece.entry, rows):
                        nbytes = piece.end - piece.start
                        start = head if head + nbytes <= ring_bytes else 0
                        end = start + nbytes
                        # Pieces are placed in the order they are sent, so the ones in the way are the oldest.
                        while in_flight and any(s < end and start < e for s, e, *_ in in_flight):
                            complete_oldest()
                        assert ring is not None  # sized for this sync's casts
                        tensor = ring[start:end].view(piece.entry.dtype).view(rows.shape)
                        tensor.copy_(rows)
                        head = aligned(end)
                try:
                    works = [dist.isend(tensor, dst=receiver, group=self.sender_group) for receiver in self.receivers]
                except RuntimeError as exc:  # a member already gone can fail the post itself
                    raise comm_error(describe(index), exc, self.timeout, peer) from exc
                in_flight.append((start, end, index, works))
        while in_flight:
            complete_oldest()
