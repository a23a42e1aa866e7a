"""Who am I and how do I talk: device, backend, the default process group, bounded waits, clean shutdown."""

from __future__ import annotations

import contextlib
import datetime
import os
import re
import secrets
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from spmd_rl.runtime import meeting
from spmd_rl.runtime.errors import CommError, UserCodeError, UserError
from spmd_rl.runtime.job_store import open_rendezvous
from spmd_rl.runtime.launch import LaunchInfo
from spmd_rl.runtime.postmortem import set_job_key
from spmd_rl.runtime.signals import signals_held_off
from spmd_rl.runtime.watchdog import COLLECTIVE_MARGIN_S

NCCL_WATCHDOG_MARGIN = datetime.timedelta(seconds=60)


@dataclass
class Runtime:
    launch: LaunchInfo
    device: torch.device
    backend: str
    timeout: datetime.timedelta

    @property
    def rank(self) -> int:
        return self.launch.rank

    @property
    def world_size(self) -> int:
        return self.launch.world_size

    @property
    def distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    @property
    def group_timeout(self) -> datetime.timedelta:
        """The process groups' own timeout. With NCCL, later than every bounded wait: its watchdog aborts the
        process when a collective outlives the group's timeout, which would cut off the one-line error a bounded
        wait gives at dist.timeout_s."""
        return self.timeout + NCCL_WATCHDOG_MARGIN if "nccl" in self.backend else self.timeout


def choose_device(preference: str, gpu_slot: int | None, gpus_needed: int = 1) -> torch.device:
    """This rank's device. gpu_slot: its index among the ranks of its node that compute on a GPU (trainers and
    inference ranks), of which there are gpus_needed; None for an env rank, which stays on the CPU and holds no
    GPU context. Each GPU-using rank takes a GPU of its own (NCCL refuses two ranks on one GPU)."""
    if preference == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        if preference == "cuda":
            raise UserError("train.device=cuda but CUDA is not available on this machine; use train.device=auto or cpu")
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if gpus_needed > count:
        raise UserError(
            f"{gpus_needed} ranks on this node compute on a GPU (trainers and inference ranks; env ranks "
            f"stay on the CPU) but it has {count} GPU(s): run fewer ranks per node, choose a layout with "
            f"fewer trainer and inference ranks per node, or set train.device=cpu"
        )
    return torch.device("cpu") if gpu_slot is None else torch.device("cuda", gpu_slot)


def choose_backend(preference: str) -> str:
    """The same on every rank (one world group): with CUDA, CPU tensors go over gloo (env traffic, control) and CUDA
    tensors over NCCL (weights, DDP). NCCL communicators are created lazily, by the groups that use them."""
    cuda = preference != "cpu" and torch.cuda.is_available()
    return "cpu:gloo,cuda:nccl" if cuda else "gloo"


def start_runtime(
    launch: LaunchInfo,
    device_preference: str,
    timeout_s: float,
    gpu_slot: int | None = 0,
    gpus_needed: int = 1,
    job_store: dict | None = None,
) -> Runtime:
    """This rank's device and, in a distributed run, the process group (job_store: rank 0's, from open_job_store;
    None: opened here). A rank that failed its checks meanwhile ends the start: StartAbandoned."""
    device = choose_device(device_preference, gpu_slot, gpus_needed)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    runtime = Runtime(launch, device, choose_backend(device_preference), datetime.timedelta(seconds=timeout_s))
    if launch.distributed:
        if _single_host(launch):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # one host: keep gloo off other interfaces
        try:
            with signals_held_off(), _client_retries_unsaid(launch.rank):
                rendezvous = job_store or open_rendezvous(launch, runtime.timeout)
            # signals are handled while the ranks meet: waiting on the others runs Python, not a C++ call
            meeting.meet(rendezvous["store"], launch.rank, launch.world_size, runtime.timeout, COLLECTIVE_MARGIN_S)
            # No device_id: it would create the world's NCCL communicator eagerly, on env ranks too.
            with signals_held_off():
                dist.init_process_group(
                    runtime.backend,
                    rank=launch.rank,
                    world_size=launch.world_size,
                    timeout=runtime.group_timeout,
                    **rendezvous,
                )
        except (meeting.StartAbandoned, CommError):
            raise
        except Exception as exc:  # the store could not be reached or a peer never arrived
            raise CommError(
                f"rank {launch.rank}: init_process_group ({launch.launcher}, {launch.init_method}) "
                f"failed within dist.timeout_s={timeout_s}: {exc}"
            ) from exc
        _share_job_key(launch.rank)
    return runtime


@contextlib.contextmanager
def _client_retries_unsaid(rank: int) -> Iterator[None]:
    """On a rank other than 0, while its store client connects to rank 0's store: torch's client writes an error, a
    warning and a C++ stack trace to stderr at each retry while rank 0 is not there yet (40 lines when it never came,
    before the rank's own line; fault pass 4, B6c). Nothing else of this rank is said meanwhile: if the connection
    fails, the rank's one line says so."""
    if rank == 0:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as nowhere:
            os.dup2(nowhere.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


JOB_KEY_BYTES = 32


def _share_job_key(rank: int) -> None:
    """Rank 0 draws the job's secret and broadcasts it over the new group (not the store: any local process can
    read and write that); failure records in the store are signed with it (spmd_rl.runtime.postmortem)."""
    key = torch.zeros(JOB_KEY_BYTES, dtype=torch.uint8)
    if rank == 0:
        key.copy_(torch.frombuffer(bytearray(secrets.token_bytes(JOB_KEY_BYTES)), dtype=torch.uint8))
    try:
        dist.broadcast(key, src=0)  # a CPU tensor: gloo, also beside NCCL
    except Exception as exc:
        raise CommError(
            f"rank {rank}: receiving the job's key from rank 0 failed: {exc}", peers=(0,) if rank else ()
        ) from exc
    set_job_key(key.numpy().tobytes())


def _single_host(launch: LaunchInfo) -> bool:
    return launch.local_world_size == launch.world_size


@dataclass(frozen=True)
class Peer:
    """Whom a wait depends on, for its failure message: a name ('rank 0 (inference 0)') and the rank(s)."""

    name: str
    ranks: tuple[int, ...]


def group_peer(group: dist.ProcessGroup | None) -> Peer:
    """The other members of a collective's group (None: the default group)."""
    me = dist.get_rank()
    others = tuple(r for r in dist.get_process_group_ranks(group or dist.group.WORLD) if r != me)
    return Peer(f"rank {others[0]}" if len(others) == 1 else f"one of ranks {list(others)}", others)


# How gloo and NCCL word the two failures a peer causes (lower case). Everything else is shown as it is.
_TIMED_OUT = ("timed out", "timeout")
_CLOSED = ("closed by peer", "reset by peer", "broken pipe", "connection refused", "socket closed")
_COMM_LIBRARIES = ("gloo", "nccl", "connection closed", "connection reset", "timed out waiting")


def _first_line(exc: BaseException) -> str:
    """The library's message without its source path prefix ('[.../pair.cc:537] ') and boilerplate advice."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    text = re.sub(r"^\[[^\]]*\]\s*", "", text)
    return text.split(" This is typically caused")[0].rstrip(". ")


def is_comm_failure(exc: BaseException | None) -> bool:
    """Whether exc (or an exception it was raised from) is torch.distributed failing to talk to a peer, e.g. DDP's
    gradient all-reduce inside backward(), which surfaces as a plain RuntimeError."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, (CommError, dist.DistError)) or any(m in str(exc).lower() for m in _COMM_LIBRARIES):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def as_comm_error(exc: BaseException, who: str) -> CommError | None:
    """exc as a communication error: itself when it is a CommError; for torch's own collective failing as a plain
    RuntimeError where no bounded wait of ours is around it (FSDP2's all-gather in a sharded policy's forward, on
    the colocated layout's acting path) a CommError naming the other ranks, so the line is one line and rank 0's
    summary names the rank that went; None for anything else (an error in user code stays one)."""
    if isinstance(exc, CommError):
        return exc
    if isinstance(exc, UserCodeError) or not is_comm_failure(exc):
        return None
    others = group_peer(None) if dist.is_initialized() else None
    where = _torch_collective(exc)
    return comm_error(f"{who}: a collective inside torch{f' ({where})' if where else ''}", exc, None, others)


# Which of torch's own collectives a plain RuntimeError came from, by a frame of its source file: the line named
# FSDP's all-gather for every one, also a DDP job's (fault pass 5, P1: rank 1's engine raised while rank 0's DDP
# broadcast the policy at its construction).
_TORCH_COLLECTIVES = (
    ("/torch/nn/parallel/distributed.py", "DDP's broadcast of the policy or its gradient all-reduce"),
    ("/torch/distributed/fsdp/", "FSDP's all-gather of a sharded policy"),
    ("/torch/distributed/_composable/fsdp/", "FSDP's all-gather of a sharded policy"),
)


def _torch_collective(exc: BaseException | None) -> str | None:
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        tb = exc.__traceback__
        while tb is not None:
            path = tb.tb_frame.f_code.co_filename.replace("\\", "/")
            for part, words in _TORCH_COLLECTIVES:
                if part in path:
                    return words
            tb = tb.tb_next
        exc = exc.__cause__ or exc.__context__
    return None


def comm_error(
    what: str, exc: BaseException, timeout: datetime.timedelta | None, peer: Peer | None = None
) -> CommError:
    """The CommError for a failed wait or post: `what` names this rank and the operation ('rank 2 (env 0): receive
    of message 7 on channel ...'); the reason says in words what the peer did, then the library's own words.

    A timeout cannot tell a stopped peer from one that waits on a third rank itself, so it says both; rank 0's job
    summary (spmd_rl.runtime.postmortem) names the rank the others waited on."""
    if isinstance(exc, CommError):
        return exc
    text = _first_line(exc)
    lowered = text.lower()
    name = peer.name if peer is not None else "a peer"
    timed_out = any(marker in lowered for marker in _TIMED_OUT)
    if timed_out:
        bound = f"dist.timeout_s={timeout.total_seconds():g}s" if timeout is not None else "the group's timeout"
        reason = (
            f"{name} did not respond within {bound}: it is stopped or hung, or it may itself be waiting on "
            f"another rank (a knock-on)"
        )
    elif any(marker in lowered for marker in _CLOSED):
        reason = f"{name} closed the connection: it exited first (its own line says why; a killed rank prints none)"
    else:
        reason = f"error talking to {name}"
    return CommError(f"{what} failed: {reason} [{text}]", peer.ranks if peer is not None else (), timed_out)


def wait(work, timeout: datetime.timedelta, describe, peer: Peer | None = None) -> None:
    """Wait for an async operation, turning an expired or broken wait into a CommError (see comm_error).

    describe() builds the message lazily (this rank, the operation), so the fast path costs nothing; peer is who
    the wait depends on.
    """
    try:
        work.wait(timeout)
    except Exception as exc:
        raise comm_error(describe(), exc, timeout, peer) from exc


def bounded(collective, *args, group, timeout: datetime.timedelta, what: str, **kwargs):
    """Run a torch.distributed collective (all_reduce, broadcast, all_gather, ...) on `group` with a bounded wait.

    The one idiom for every collective: async_op=True, then `wait` within the timeout; a failed post, an expired or
    a broken wait is a CommError naming this rank, the operation and the group's other members."""
    peer = group_peer(group)

    def describe() -> str:
        return f"rank {dist.get_rank()}: {what} with ranks {dist.get_process_group_ranks(group or dist.group.WORLD)}"

    try:
        work = collective(*args, group=group, async_op=True, **kwargs)
    except RuntimeError as exc:  # a peer that is already gone can fail the post itself
        raise comm_error(describe(), exc, timeout, peer) from exc
    wait(work, timeout, describe, peer)
    return work


def shutdown_runtime(runtime: Runtime | None, exit_code: int) -> None:
    """Destroy the process group. After a failure peers may be gone, so never let the teardown itself hang."""
    if runtime is None or not runtime.distributed:
        return
    if exit_code != 0:
        # A group with a dead or waiting peer can block in destroy; this process is exiting with an error anyway,
        # and its exit is what tells the launcher (and, through broken connections, the peers) to stop.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(exit_code)
    done = threading.Event()

    def watchdog():
        if not done.wait(30):
            print(f"rank {runtime.rank}: destroy_process_group did not finish in 30 s; exiting", file=sys.stderr)
            os._exit(1)

    threading.Thread(target=watchdog, daemon=True).start()
    dist.destroy_process_group()
    done.set()


def broadcast_text(
    text: str,
    src: int = 0,
    max_bytes: int = 4096,
    group: dist.ProcessGroup | None = None,
    timeout: datetime.timedelta | None = None,
) -> str:
    """src's text on every rank, sent as a fixed-size uint8 tensor (a 4-byte length, then UTF-8): no pickle.

    Every rank must call it with the same max_bytes. A text longer than max_bytes is a UserError on every rank
    (src sends a length that says so), so no rank is left waiting.
    """
    too_long = 0xFFFFFFFF
    message = torch.zeros(4 + max_bytes, dtype=torch.uint8)
    if dist.get_rank() == src:
        data = text.encode()
        length = len(data) if len(data) <= max_bytes else too_long
        message[:4] = torch.frombuffer(bytearray(length.to_bytes(4, "little")), dtype=torch.uint8)
        if 0 < length != too_long:  # (frombuffer refuses an empty buffer)
            message[4 : 4 + length] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    describe = f"rank {dist.get_rank()}: broadcast_text from rank {src}"
    peer = Peer(f"rank {src}", (src,)) if dist.get_rank() != src else group_peer(group)
    if timeout is not None:
        wait(dist.broadcast(message, src=src, group=group, async_op=True), timeout, lambda: describe, peer)
    else:  # bounded by the process group's own timeout
        try:
            dist.broadcast(message, src=src, group=group)
        except Exception as exc:
            raise comm_error(describe, exc, None, peer) from exc
    length = int.from_bytes(message[:4].numpy().tobytes(), "little")
    if length == too_long:
        raise UserError(
            f"rank {src}'s text to broadcast is longer than {max_bytes} bytes (UTF-8); use a shorter "
            f"one (e.g. a shorter run.dir)"
        )
    return message[4 : 4 + length].numpy().tobytes().decode()


def agree_on_refusal(refusal: str, timeout: datetime.timedelta, max_bytes: int = 4096) -> str:
    """Every rank's refusal heard by all (a collective of the world): '' on every rank when none refused, else the
    refusal of the lowest rank that refused, on every rank. What a rank checks alone before a collective that its
    peers would otherwise enter without it (a checkpoint's files before the sharded load)."""
    world = dist.get_world_size()
    first = torch.tensor([dist.get_rank() if refusal else world], dtype=torch.int64)
    bounded(dist.all_reduce, first, group=None, timeout=timeout, what="agreeing on a refusal", op=dist.ReduceOp.MIN)
    src = int(first.item())
    if src == world:
        return ""
    cut = refusal.encode()[:max_bytes].decode(errors="ignore")  # a refusal is one line; never too long to send
    return broadcast_text(cut, src=src, max_bytes=max_bytes, timeout=timeout)
