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

import datetime
import hashlib
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
    view: torch.Tensor | None = None

    def current(self) -> torch.Tensor:
        return (self.owner._parameters if self.is_param else self.owner._buffers)[self.attr]

    def point_at_view(self) -> None:
        if self.is_param:
            self.owner._parameters[self.attr].data = self.view
        else:
            self.owner._buffers[self.attr] = self.view


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


class WeightSync:
    """Broadcast a module's weights from src to the other members of group, and check they agree.

    Every member of the group builds one, with the same module architecture, in the same order as its other
    collectives in that group; non-members must not (a collective called by a non-member silently does nothing).
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
    ):
        self.group, self.src, self.me, self.describe_rank = group, src, me, describe_rank
        self.timeout = timeout if isinstance(timeout, datetime.timedelta) else datetime.timedelta(seconds=timeout)
        self.members = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
        if me not in self.members or src not in self.members:
            who = describe_rank(me) if me not in self.members else f"the source {describe_rank(src)}"
            raise ValueError(
                f"WeightSync: {who} is not a member of the weight group {self.members}; only members "
                f"may take part in weight broadcasts"
            )
        self.module = module
        self.entries, self.buckets = self._lay_out(module, bucket_bytes)
        self.digest = self._layout_digest(bucket_bytes)
        header = self.buckets[0][:HEADER_BYTES].view(torch.int64)
        self._header = header.numpy() if header.device.type == "cpu" else header  # numpy: cheap element writes
        self._header[0] = -1  # no version received yet
        self._header[1] = self.digest
        self._check_same_models()

    # --- layout -----------------------------------------------------------------------------------------------
    def _lay_out(self, module: nn.Module, bucket_bytes: int) -> tuple[list[_Entry], list[torch.Tensor]]:
        named = [(name, True) for name, _ in module.named_parameters()]
        named += [(name, False) for name, b in module.named_buffers() if b is not None]
        if not named:
            raise ValueError("WeightSync: the module has no parameters or buffers to broadcast")
        tensors = {}
        for name, is_param in named:
            owner_name, _, attr = name.rpartition(".")
            owner = module.get_submodule(owner_name)
            tensors[name] = (owner, attr, is_param, (owner._parameters if is_param else owner._buffers)[attr])
        devices = {t.device for *_, t in tensors.values()}
        if len(devices) != 1:
            raise ValueError(
                f"WeightSync: the module's tensors are on several devices {sorted(map(str, devices))}; "
                f"move it to one device first"
            )
        device = devices.pop()

        # Tensors in module order, packed into byte buckets at aligned offsets: every member computes the same
        # layout from the same architecture. Dtypes share buckets (a broadcast moves bytes), so a float32 policy
        # with float64 normalizer statistics and an int64 counter is one collective, not three.
        entries, sizes = [], []
        used = start = 0  # bytes used in the open bucket, and where its data starts
        for name, (owner, attr, is_param, tensor) in tensors.items():
            nbytes = tensor.numel() * tensor.element_size()
            if not sizes or (used > start and aligned(used) + nbytes > bucket_bytes):
                used = start = 0 if sizes else HEADER_BYTES
                sizes.append(used)
            offset = aligned(used)
            entries.append(_Entry(name, owner, attr, is_param, len(sizes) - 1, offset))
            used = sizes[-1] = offset + nbytes
        buckets = [torch.zeros(aligned(size), dtype=torch.uint8, device=device) for size in sizes]
        for entry in entries:
            tensor = entry.current()
            nbytes = tensor.numel() * tensor.element_size()
            entry.view = (
                buckets[entry.bucket][entry.offset : entry.offset + nbytes].view(tensor.dtype).view(tensor.shape)
            )
            entry.view.copy_(tensor.detach())
            entry.point_at_view()
        return entries, buckets

    def _layout_digest(self, bucket_bytes: int) -> int:
        text = repr([(e.name, tuple(e.view.shape), str(e.view.dtype), e.bucket, e.offset) for e in self.entries])
        return int.from_bytes(hashlib.sha256(f"{bucket_bytes}:{text}".encode()).digest()[:8], "little", signed=True)

    def _data(self, index: int) -> torch.Tensor:
        """Bucket index without the header: the bytes the checksum covers."""
        return self.buckets[index][HEADER_BYTES:] if index == 0 else self.buckets[index]

    def describe_bucket(self, index: int) -> str:
        names = [e.name for e in self.entries if e.bucket == index]
        shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        return f"bucket {index} ({self.buckets[index].numel()} bytes: {shown})"

    # --- collectives ------------------------------------------------------------------------------------------
    def _all_gather(self, values: list[int], what: str) -> list[list[int]]:
        """values from every member, in the order of self.members."""
        mine = torch.tensor(values, dtype=torch.int64, device=self.buckets[0].device)
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
        gathered = self._all_gather(
            [self.digest, len(self.entries), sum(b.numel() for b in self.buckets)], "weight layout check"
        )
        source = gathered[self.members.index(self.src)]
        differing = [
            f"{self.describe_rank(rank)} ({count} tensors, {nbytes} bytes)"
            for rank, (digest, count, nbytes) in zip(self.members, gathered)
            if digest != source[0]
        ]
        if differing:
            raise WeightMismatchError(
                f"the weight layout (parameter and buffer names, shapes, dtypes, weights.bucket_mb) of "
                f"{', '.join(differing)} differs from the source {self.describe_rank(self.src)} ({source[1]} "
                f"tensors, {source[2]} bytes): every member must build the same model with the same config"
            )

    def _adopt_module_tensors(self) -> None:
        """Copy any tensor the module replaced (instead of updating in place) into its bucket; re-point it."""
        for entry in self.entries:
            current = entry.current()
            if current.data_ptr() != entry.view.data_ptr():
                entry.view.copy_(current.detach())
                entry.point_at_view()

    def broadcast(self, version: int) -> int:
        """Source: send the module's weights with this version. Receivers: load them; returns the version.

        Every member calls it at the same point of its schedule; receivers' version argument is ignored.
        """
        is_source = self.me == self.src
        if is_source:
            self._adopt_module_tensors()
            self._header[0] = version
        receivers = tuple(rank for rank in self.members if rank != self.src)
        peer = (
            Peer(self.describe_rank(self.src), (self.src,))
            if not is_source
            else Peer(
                self.describe_rank(receivers[0]) if len(receivers) == 1 else f"one of ranks {list(receivers)}",
                receivers,
            )
        )

        def describe(index: int) -> str:
            return (
                f"{self.describe_rank(self.me)}: weight broadcast from {self.describe_rank(self.src)} (bucket "
                f"{index + 1} of {len(self.buckets)}{f', version {version}' if is_source else ''})"
            )

        works = []
        for index, bucket in enumerate(self.buckets):
            try:
                works.append(dist.broadcast(bucket, src=self.src, group=self.group, async_op=True))
            except RuntimeError as exc:  # a member already gone can fail the post itself
                raise comm_error(describe(index), exc, self.timeout, peer) from exc
        for index, work in enumerate(works):
            wait(work, self.timeout, lambda index=index: describe(index), peer)
        received_version, digest = self._header.tolist()
        if digest != self.digest:
            raise WeightMismatchError(
                f"{self.describe_rank(self.me)}: weights from {self.describe_rank(self.src)} "
                f"carry layout digest {digest}, this rank's is {self.digest}"
            )
        if not is_source:
            for entry in self.entries:
                if entry.current().data_ptr() != entry.view.data_ptr():
                    entry.point_at_view()
        return received_version

    def checksums(self) -> list[int]:
        return [bucket_checksum(self._data(index)) for index in range(len(self.buckets))]

    def verify(self, version: int) -> None:
        """Check that every member holds the source's weights of this version, bit for bit.

        Collective over the group; call it where the source has not changed its weights since broadcast(version)
        (e.g. right after it). On any mismatch every member raises the same WeightMismatchError naming the ranks,
        the buckets and the version.
        """
        self._adopt_module_tensors()
        gathered = self._all_gather(
            [version, int(self._header[0])] + self.checksums(), f"weight verify of version {version}"
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
