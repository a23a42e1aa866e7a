"""Planned allocations against the memory this host can give: an absurd config (a replay buffer of a trillion rows)
fails at start-up with a UserError naming the key to lower, not minutes later in the kernel's OOM killer.

The check is meant to catch plans that cannot fit, not to budget tightly: it compares with what is available
before the run allocates anything, and counts page cache as available (the kernel gives it back).
"""

from __future__ import annotations

import os
import resource
import sys
from pathlib import Path

from spmd_rl.runtime.errors import UserError

CGROUP_ROOT = Path("/sys/fs/cgroup")


def check_memory(bytes_needed: int, what: str, key: str, held_bytes: int = 0) -> None:
    """Raise a UserError naming `key` when `what` (e.g. "the replay buffer of rank 3") would need more memory than
    this host has available. bytes_needed: what the host's ranks will hold together for it; held_bytes: what of it
    this process holds already (and will free first), available on top of what the host has left."""
    available = available_memory()
    if available is not None:
        available += held_bytes
    if available is not None and bytes_needed > available:
        raise UserError(
            f"{what} needs {_size(bytes_needed)} of memory but this host has {_size(available)} available; lower {key}"
        )


# What training holds per parameter: its fp32 weight, its fp32 gradient and Adam's two fp32 moments.
BYTES_PER_TRAINED_PARAMETER = 4 + 4 + 8


def training_state_bytes(parameters: int, shards: int = 1) -> int:
    """Bytes one trainer rank holds for a module of `parameters` parameters that it trains with Adam: weights,
    gradients and optimizer state, divided over `shards` ranks when they are sharded (FSDP; 1 = replicated, DDP).
    Activations are not counted: they depend on the batch."""
    return -(-parameters * BYTES_PER_TRAINED_PARAMETER // max(1, shards))


def peak_rss_mb() -> float:
    """This process's peak resident memory so far, in MiB (getrusage: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10


def available_memory() -> int | None:
    """Bytes this process may still allocate: the host's MemAvailable (or, where there is no /proc, its physical
    memory), lowered to a cgroup memory limit (a Slurm job's, a container's) when one applies; None if unknown."""
    host = _meminfo_available()
    if host is None:
        try:
            host = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            host = None
    known = [size for size in (host, *_cgroup_limits()) if size is not None]
    return min(known) if known else None


def _meminfo_available() -> int | None:
    try:
        lines = Path("/proc/meminfo").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        name, _, value = line.partition(":")
        if name == "MemAvailable":
            return int(value.split()[0]) * 1024  # the kernel writes kB meaning KiB
    return None


def _cgroup_limits() -> list[int]:
    """The memory limits of this process's cgroups and their ancestors (a Slurm step's limit may sit on the job)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return []
    limits = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # cgroup v2
            root, limit_file = CGROUP_ROOT, "memory.max"
        elif "memory" in controllers.split(","):  # cgroup v1
            root, limit_file = CGROUP_ROOT / "memory", "memory.limit_in_bytes"
        else:
            continue
        folder = root / path.lstrip("/")
        if not folder.is_dir():  # a container that mounts its own cgroup as the root
            folder = root
        for level in (folder, *(parent for parent in folder.parents if parent.is_relative_to(root))):
            try:
                text = (level / limit_file).read_text().strip()
            except OSError:
                continue
            if text.isdigit():  # "max" (v2) means none; v1 writes a huge number, which min() ignores
                limits.append(int(text))
    return limits


def _size(size: int) -> str:
    return f"{size / 2**30:.1f} GiB" if size >= 2**30 else f"{size / 2**20:.1f} MiB"
