"""An inference rank's next weight broadcast, received in the background into a staging copy.

WeightSync.broadcast receives straight into the buckets the policy's tensors are views of, which is right when
weights arrive at a fixed point between rollouts (sync engine) and wrong when they may arrive in the middle of a
forward pass (async engine). StagedWeights posts the k-th broadcast of the weight group (async_op) into buckets of
its own, ahead of time; the inference rank polls it between forward passes and, once it is complete, copies it
into the live buckets (`swap`). The broadcasts are the same collectives, in the same order, as the source's
`WeightSync.broadcast` calls: the k-th one a receiver posts is the k-th the source makes.
"""

from __future__ import annotations

import threading
import time

import torch

from spmd_rl.comm.weights import HEADER_BYTES, WeightSync
from spmd_rl.runtime.distributed import comm_error, wait

# Polling a posted broadcast: the first pause, doubled up to the longest (a swap waits at most that long after the
# broadcast completed).
POLL_FIRST_S = 0.0001
POLL_LONGEST_S = 0.002


class StagedWeights:
    def __init__(self, sync: WeightSync):
        if sync.me == sync.src:
            raise ValueError("StagedWeights is for the receivers of a weight broadcast, not its source")
        self.sync = sync
        # Zeros: sharded senders' pieces fill only the tensors' bytes, and the alignment gaps are checksummed too.
        self.staging = [torch.zeros_like(bucket) for bucket in sync.buckets]
        header = self.staging[0][:HEADER_BYTES].view(torch.int64)
        self._header = header.numpy() if header.device.type == "cpu" else header
        self.peer = sync.broadcast_peer()
        self._works: list | None = None
        # Gloo's point-to-point works (the pieces of sharded senders) report completion only from wait(): a thread
        # waits on them, and its end is what ready() polls. Broadcasts and NCCL works are polled directly.
        self._waiter: threading.Thread | None = None
        self._failure: BaseException | None = None
        self.posted = 0  # broadcasts posted so far (the one in flight is number `posted`)

    def _describe(self) -> str:
        return (
            f"{self.sync.describe_rank(self.sync.me)}: weight broadcast number {self.posted} from "
            f"{self.sync.describe_rank(self.sync.src)} (into the staging copy)"
        )

    def post(self) -> None:
        """Post the next broadcast of the weight group into the staging buckets."""
        assert self._works is None, "one staged broadcast at a time"
        self.posted += 1
        works = []
        self._indices = self.sync.buckets_to_send()  # frozen parameters' buckets only with the first broadcast
        for index in self._indices:
            try:
                works += self.sync.post_receive(index, self.staging[index])
            except RuntimeError as exc:  # a member already gone can fail the post itself
                raise comm_error(self._describe(), exc, self.sync.timeout, self.peer) from exc
        self._works = works
        if self.sync.pieces is not None and self.sync.device.type == "cpu":
            self._failure = None
            self._waiter = threading.Thread(target=self._wait_for_pieces, args=(works,), daemon=True)
            self._waiter.start()

    def _wait_for_pieces(self, works: list) -> None:
        try:
            for work in works:
                work.wait(self.sync.timeout)
        except BaseException as exc:  # noqa: BLE001 - handed to wait(), which raises it as a CommError
            self._failure = exc

    def ready(self) -> bool:
        """Whether the posted broadcast has completed (a failed one counts as complete; swap() raises it)."""
        if self._works is None:
            return False
        if self._waiter is not None:
            return not self._waiter.is_alive()
        return all(work.is_completed() for work in self._works)

    def wait(self) -> None:
        """Block until the posted broadcast is complete, bounded by dist.timeout_s. Completion is polled first and
        the work waited on only once it is done: NCCL's wait() makes the current CUDA stream wait for the
        broadcast, which would stall this rank's forward passes until trainer 0 sends, and trainer 0 sends only
        after segments those forward passes must produce (gloo's wait blocks only the CPU)."""
        deadline = time.monotonic() + self.sync.timeout.total_seconds()
        pause = POLL_FIRST_S
        while not self.ready():
            if time.monotonic() > deadline:
                raise comm_error(
                    self._describe(), TimeoutError("timed out waiting for the broadcast"), self.sync.timeout, self.peer
                )
            time.sleep(pause)
            pause = min(2 * pause, POLL_LONGEST_S)
        if self._waiter is not None:
            if self._failure is not None:
                raise comm_error(self._describe(), self._failure, self.sync.timeout, self.peer) from self._failure
            return
        assert self._works is not None  # ready() above
        for work in self._works:
            wait(work, self.sync.timeout, self._describe, self.peer)

    def version(self) -> int:
        """The version a completed broadcast carries (read before swapping it in)."""
        self.wait()
        return int(self._header[0])

    def swap(self) -> int:
        """Take the completed broadcast: its bytes into the live buckets (between forward passes); its version."""
        self.wait()
        self._works = self._waiter = None
        version, digest = (int(value) for value in self._header.tolist())
        self.sync._check_digest(digest)
        for index in self._indices:
            self.sync.buckets[index].copy_(self.staging[index])
        self.sync.broadcasts += 1
        self.sync.point_module_at_buckets()
        return version
