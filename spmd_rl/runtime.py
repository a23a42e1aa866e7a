"""Who am I and how do I talk: device, backend, the default process group, bounded waits, clean shutdown."""

from __future__ import annotations

import datetime
import os
import signal
import sys
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist

from spmd_rl.errors import CommError, StopSignal, UserError
from spmd_rl.launch import LaunchInfo


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


def choose_device(preference: str, local_rank: int) -> torch.device:
    if preference == "cpu":
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    if preference == "cuda":
        raise UserError("train.device=cuda but CUDA is not available on this machine; use train.device=auto or cpu")
    return torch.device("cpu")


def choose_backend(device: torch.device) -> str:
    # With CUDA, one group carries CPU tensors over gloo (env traffic) and CUDA tensors over NCCL (weights, DDP).
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def start_runtime(launch: LaunchInfo, device_preference: str, timeout_s: float) -> Runtime:
    device = choose_device(device_preference, launch.local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    runtime = Runtime(launch, device, choose_backend(device), datetime.timedelta(seconds=timeout_s))
    if launch.distributed:
        if _single_host(launch):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # one host: keep gloo off other interfaces
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        try:
            dist.init_process_group(runtime.backend, init_method=launch.init_method, rank=launch.rank,
                                    world_size=launch.world_size, timeout=runtime.timeout, **kwargs)
        except Exception as exc:  # the store could not be reached or a peer never arrived
            raise CommError(f"rank {launch.rank}: init_process_group ({launch.launcher}, {launch.init_method}) "
                            f"failed within dist.timeout_s={timeout_s}: {exc}") from exc
    return runtime


def _single_host(launch: LaunchInfo) -> bool:
    return launch.local_world_size == launch.world_size


def wait(work, timeout: datetime.timedelta, describe) -> None:
    """Wait for an async operation, turning an expired or broken wait into a CommError.

    describe() builds the message lazily (who waited for whom, for what), so the fast path costs nothing.
    """
    try:
        work.wait(timeout)
    except Exception as exc:
        raise CommError(f"{describe()} failed after at most {timeout.total_seconds():g}s: "
                        f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from exc


def bounded(collective, *args, group, timeout: datetime.timedelta, what: str, **kwargs):
    """Run a torch.distributed collective (all_reduce, broadcast, all_gather, ...) on `group` with a bounded wait.

    The one idiom for every collective: async_op=True, then `wait` within the timeout; an expired or broken wait
    is a CommError naming this rank, the operation and the group's members."""
    work = collective(*args, group=group, async_op=True, **kwargs)
    wait(work, timeout, lambda: f"rank {dist.get_rank()}: {what} with ranks {dist.get_process_group_ranks(group)}")
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


def broadcast_text(text: str, src: int = 0, max_bytes: int = 4096, group: dist.ProcessGroup | None = None,
                   timeout: datetime.timedelta | None = None) -> str:
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
        if length != too_long:
            message[4:4 + length] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    describe = f"rank {dist.get_rank()}: broadcast_text from rank {src}"
    if timeout is not None:
        wait(dist.broadcast(message, src=src, group=group, async_op=True), timeout, lambda: describe)
    else:  # bounded by the process group's own timeout
        try:
            dist.broadcast(message, src=src, group=group)
        except Exception as exc:
            raise CommError(f"{describe} failed: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") \
                from exc
    length = int.from_bytes(message[:4].numpy().tobytes(), "little")
    if length == too_long:
        raise UserError(f"rank {src}'s text to broadcast is longer than {max_bytes} bytes (UTF-8); use a shorter "
                        f"one (e.g. a shorter run.dir)")
    return message[4:4 + length].numpy().tobytes().decode()


def install_signal_handlers() -> None:
    """Turn SIGTERM and SIGUSR1 into StopSignal and SIGINT into KeyboardInterrupt, raised in the main thread.

    Without this, SIGTERM (what torchrun, Slurm and `kill` send) ends the process at once: no finally-block runs
    and staged experience rows are lost. The exception is held back while a file commit is in progress (see
    signals_deferred) and raised when it ends. Python runs handlers between bytecodes, so a rank blocked inside a
    C++ wait sees the signal when that wait returns (at most dist.timeout_s later). Main thread only.
    """
    for signum in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        signal.signal(signum, _on_signal)


class _Deferral:
    depth = 0
    pending: BaseException | None = None


def _on_signal(signum: int, frame) -> None:
    stop = KeyboardInterrupt() if signum == signal.SIGINT else StopSignal(signal.Signals(signum).name, signum)
    if _Deferral.depth:
        _Deferral.pending = _Deferral.pending or stop
        return
    raise stop


class signals_deferred:
    """`with signals_deferred():` a section that a signal must not cut in half (a file write and its commit).

    A signal that arrives inside is raised when the outermost section ends; if the section ends with an error
    anyway, that error goes on and the signal is dropped (the process is unwinding already).
    """

    def __enter__(self) -> None:
        _Deferral.depth += 1

    def __exit__(self, exc_type, exc, traceback) -> None:
        _Deferral.depth -= 1
        if _Deferral.depth or _Deferral.pending is None:
            return
        pending, _Deferral.pending = _Deferral.pending, None
        if exc_type is None:
            raise pending
