"""In-process channels (the colocated layout, where both ends live in one process): the same interface as
channel.py's SendChannel and RecvChannel, with TensorDicts handed over by reference."""

from __future__ import annotations

import collections

from tensordict import TensorDict, TensorDictBase

from spmd_rl.comm.channel import TensorLayout


class _Done:
    """The handle of a local send: complete the moment it is made."""

    __slots__ = ()

    def wait(self) -> None:
        return None


class LocalSendChannel:
    """The sending end of an in-process channel (colocated layout): messages are handed over by reference.

    Same interface as SendChannel. `.buffer` is this end's preallocated message; `isend()` queues that very
    TensorDict, so it must not be rewritten before the receiver has taken it (sending it again while it is still
    queued is an error). `isend(td)` queues td itself, which the caller must then leave alone.
    """

    def __init__(self, queue: collections.deque, layout: TensorLayout, name: str, describe: str):
        self.layout, self.name, self._queue, self._describe = layout, name, queue, describe
        _, self._buffer = layout.allocate("cpu")

    @property
    def buffer(self) -> TensorDict:
        return self._buffer

    def wait(self) -> None:
        return None

    def isend(self, td: TensorDictBase | None = None) -> _Done:
        message = self._buffer if td is None else td
        if message is not self._buffer:
            self.layout.check(message, lambda: f"local channel {self.name!r} ({self._describe})")
        elif any(queued is self._buffer for queued in self._queue):
            raise RuntimeError(
                f"local channel {self.name!r} ({self._describe}): the send buffer is sent again "
                f"before the receiver took the previous message; the schedule is out of step"
            )
        self._queue.append(message)
        return _Done()

    def send(self, td: TensorDictBase | None = None) -> None:
        self.isend(td)


class _LocalRecvHandle:
    __slots__ = ("_channel",)

    def __init__(self, channel: LocalRecvChannel):
        self._channel = channel

    def wait(self) -> TensorDictBase:
        return self._channel._take()


class LocalRecvChannel:
    """The receiving end of an in-process channel. Same interface as RecvChannel; irecv() takes the message when
    waited. Nothing queued at that point is an error: in one process an empty queue means a schedule bug, and
    waiting would wait forever."""

    def __init__(self, queue: collections.deque, layout: TensorLayout, name: str, describe: str):
        self.layout, self.name, self._queue, self._describe = layout, name, queue, describe

    def irecv(self) -> _LocalRecvHandle:
        return _LocalRecvHandle(self)

    def recv(self) -> TensorDictBase:
        return self._take()

    def _take(self) -> TensorDictBase:
        if not self._queue:
            raise RuntimeError(
                f"local channel {self.name!r} ({self._describe}): receive with no message sent; "
                f"the schedule is out of step"
            )
        return self._queue.popleft()


def local_channel(
    name: str, example: TensorDictBase, describe: str = "in process"
) -> tuple[LocalSendChannel, LocalRecvChannel]:
    """Both ends of an in-process channel carrying TensorDicts laid out like example (FIFO)."""
    queue: collections.deque = collections.deque()
    layout = TensorLayout.of(example)
    return LocalSendChannel(queue, layout, name, describe), LocalRecvChannel(queue, layout, name, describe)
