"""Who am I and how do I talk: device, backend, the default process group, bounded waits, clean shutdown."""

from __future__ import annotations

import datetime
import os
import sys
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist

from spmd_rl.errors import CommError, UserError
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

