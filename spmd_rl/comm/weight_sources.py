"""The trainers' side of a weight broadcast when the module's own tensors cannot be the buckets (weights.py's
WeightSync is the side where they can, and every receiver's): GatheredWeightSource all-gathers each bucket's
sharded parameters (or casts replicated ones to another wire dtype) into one bucket-sized buffer that the first
trainer broadcasts; ShardedWeightSource has every sharded trainer send its own rows instead, no all-gather. Both
lay out the buckets exactly as the receivers' WeightSync does."""

from __future__ import annotations

import collections
import datetime
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from spmd_rl.comm.flat import aligned
from spmd_rl.comm.sharding import is_dtensor
from spmd_rl.comm.weights import (
    HEADER_BYTES,
    WeightGroupMember,
    _Entry,
    bucket_checksum,
    element_size,
    lay_out,
    plain_rank,
    shard_pieces,
)
from spmd_rl.runtime.distributed import Peer, comm_error, wait

if TYPE_CHECKING:  # annotations only: torch.distributed.tensor is imported when a run shards
    from torch.distributed.tensor import DTensor


def _local(sharded: DTensor) -> torch.Tensor:
    """A DTensor's local shard as it is stored, outside autograd. to_local() in no-grad mode returns the stored
    tensor; with grad mode on it goes through an autograd function, and detach() first through DTensor's dispatch:
    together 40 us a call on an idle core (measured), paid twice for every piece of every sync, where the bytes of
    a small piece take a few microseconds on the wire."""
    with torch.no_grad():
        return sharded.to_local()


def _gather_into(view: torch.Tensor, sharded) -> bool:
    """All-gather a DTensor sharded evenly on dim 0 over a 1-D mesh straight into view (the whole tensor, in
    view's dtype: each shard is cast before it travels); False for any other layout."""
    from torch.distributed.tensor import Shard

    mesh = sharded.device_mesh
    if mesh.ndim != 1 or tuple(sharded.placements) != (Shard(0),) or sharded.shape[0] % mesh.size():
        return False
    local = _local(sharded).to(view.dtype).contiguous()
    dist.all_gather_single(view.view(-1), local.view(-1), group=mesh.get_group())
    return True


class GatheredWeightSource(WeightGroupMember):
    """The trainers' side of a weight broadcast when the module's tensors cannot be the buckets: its parameters
    are sharded over the trainers (train.parallel=fsdp), or they travel in another dtype (inference.dtype=bf16).

    Every trainer builds one at the same point and calls broadcast()/verify() at the same points: bucket by
    bucket, every trainer all-gathers the bucket's sharded parameters (one all-gather in the trainer group per
    parameter, each shard cast to the wire dtype first) straight into a bucket-sized buffer of its own, and the
    first trainer, a member of the weight group, broadcasts its buffer. A bucket with nothing sharded in it is
    filled (cast) by the first trainer alone. The first trainer holds two buckets beyond its shards (it fills the
    next while this one is broadcast), the others one (a parameter sharded unevenly goes through one whole
    temporary copy).
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
        describe_rank: Callable[[int], str] = plain_rank,
        wire_dtype: torch.dtype | None = None,
    ):
        self.is_source = me == src
        self.module = module
        self.entries, self.bucket_sizes = lay_out(module, bucket_bytes, wire_dtype)
        self.device = self.entries[0].current().device
        self.broadcasts = 0
        self.version = -1
        self._buffers: list[torch.Tensor] = []  # see buffer and broadcast
        if not self.is_source:  # a trainer that only contributes its shards to the gathers
            return
        self._join(group, src, me, timeout, describe_rank)
        self.digest = self._digest(bucket_bytes)
        self._check_same_models()

    @property
    def buffer(self) -> torch.Tensor:
        """One bucket on every trainer (the first of the source's two): the shards are all-gathered straight into
        it, in the wire dtype (made on first use; a ShardedWeightSource casts into part of it to send, and gathers
        into it only to verify). Uninitialized, so that only the pages used count: _fill writes every byte of a
        bucket it gathers."""
        return self._buffer_number(0)

    def _buffer_number(self, number: int) -> torch.Tensor:
        while len(self._buffers) <= number:
            self._buffers.append(torch.empty(max(self.bucket_sizes), dtype=torch.uint8, device=self.device))
        return self._buffers[number]

    def _gathers(self, index: int) -> bool:
        """Whether bucket index holds a sharded parameter, whose gather every trainer takes part in (otherwise only
        the source fills the bucket: the others' copies of replicated tensors would be work for nothing)."""
        return any(is_dtensor(entry.current()) for entry in self.entries if entry.bucket == index)

    @torch.no_grad()  # see _local: a sharded parameter read with grad mode on goes through autograd
    def _fill(self, index: int, version: int, into: torch.Tensor | None = None) -> torch.Tensor | None:
        """Bucket index, gathered into `into` (default: the buffer) by every trainer together; the source's to
        broadcast (returned), the others' only the output their all-gathers need (None; nothing is filled when
        the bucket has nothing to gather)."""
        if not self.is_source and not self._gathers(index):
            return None
        bucket = (self.buffer if into is None else into)[: self.bucket_sizes[index]]
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
            tensor = entry.current()  # not detached: no grad mode here, and a DTensor's detach() dispatches
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
        """Bucket by bucket: fill (gather, cast) and broadcast. The source fills the next bucket into a second
        buffer while the broadcast of this one is on the wire, and waits for a broadcast only before refilling its
        buffer; the other trainers take part in the gathers only, which need one buffer."""
        indices = self.buckets_to_send()
        in_flight: collections.deque[tuple[dist.Work, str]] = collections.deque()
        peer = self.broadcast_peer() if self.is_source else None

        def complete_oldest() -> None:
            work, describe = in_flight.popleft()
            wait(work, self.timeout, lambda: describe, peer)

        for number, index in enumerate(indices):
            if len(in_flight) == 2:  # the broadcast that used this buffer two buckets ago
                complete_oldest()
            bucket = self._fill(index, version, self._buffer_number(number % 2) if self.is_source else None)
            if bucket is None:
                continue
            describe = self._describe_broadcast(index, len(indices), version)
            try:
                work = dist.broadcast(bucket, src=self.src, group=self.group, async_op=True)
            except RuntimeError as exc:  # a member already gone can fail the post itself
                raise comm_error(describe, exc, self.timeout, peer) from exc
            in_flight.append((work, describe))
        while in_flight:
            complete_oldest()
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
        describe_rank: Callable[[int], str] = plain_rank,
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
                if rows.numel() * element_size(piece.entry.dtype) != piece.end - piece.start:
                    raise ValueError(
                        f"ShardedWeightSource: {self.describe_rank(self.me)} holds {tuple(rows.shape)} of "
                        f"{piece.entry.name} {piece.entry.shape}, not the dim-0 chunk the receivers expect"
                    )

    def _local_rows(self, entry: _Entry) -> torch.Tensor:
        """This trainer's own tensor for a piece of entry: its local rows of a parameter (in the training dtype),
        or a whole buffer."""
        tensor = entry.current()
        if is_dtensor(tensor):
            return _local(tensor)
        if entry.is_param and len(self.senders) > 1 and entry.shape:
            raise ValueError(f"ShardedWeightSource: parameter {entry.name} is not sharded; every parameter must be")
        return tensor.detach()

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

    @torch.no_grad()  # the casts into the ring read parameters: nothing here is for autograd
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
