"""The job's store, where the ranks meet before the process group forms and rank 0's job summary reads the failure
records: hosted by rank 0 on the rendezvous address (on loopback under torchrun on one host), reached by the others.
Rank 0 opens it before its checks (open_job_store), so that another rank's failed check reaches it at once
(spmd_rl.runtime.meeting)."""

from __future__ import annotations

import datetime
import errno
import os
import socket
import urllib.parse

import torch.distributed as dist

from spmd_rl.runtime.launch import LaunchInfo
from spmd_rl.runtime.signals import signals_held_off


def open_job_store(launch: LaunchInfo, timeout_s: float) -> dict | None:
    """On rank 0 of a distributed run, before its checks: init_process_group's rendezvous ({"store": ...}). None
    on the other ranks, in one process, or when it cannot be opened now (start_runtime tries again and says why)."""
    if not launch.distributed or launch.rank != 0:
        return None
    try:
        with signals_held_off():
            return open_rendezvous(launch, datetime.timedelta(seconds=timeout_s))
    except Exception:  # noqa: BLE001 - said by start_runtime's own try, in the rank's one line
        return None


def open_rendezvous(launch: LaunchInfo, timeout: datetime.timedelta) -> dict:
    """init_process_group's store. Under torchrun, its agent's store with a prefix per restart: torchrun keeps one
    store for all restarts (--max-restarts), keys included, and restarted ranks would read the addresses of the
    previous attempt's ranks (gloo: "Connection refused", then a wait until the timeout). On one host that prefix
    only carries the port of a store of our own on loopback (the agent's listens on every interface, and the
    failure records rank 0's summary trusts live in the job's store)."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if (
        launch.launcher == "torchrun"
        and attempt is not None
        and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    ):
        agent = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            launch.world_size,
            is_master=False,
            timeout=timeout,
        )
        store = dist.PrefixStore(f"spmd_rl/attempt_{attempt}", agent)
        if launch.local_world_size == launch.world_size:
            return {"store": _loopback_store(launch, store, timeout)}
        return {"store": store}
    return {"store": _own_store(launch, timeout)}


def _loopback_store(launch: LaunchInfo, meeting: dist.Store, timeout: datetime.timedelta) -> dist.TCPStore:
    """A store hosted by rank 0 on 127.0.0.1 at a port the OS picks, which rank 0 announces in `meeting`."""
    if launch.rank != 0:
        port = int(meeting.get("loopback_store_port").decode())
        return dist.TCPStore("127.0.0.1", port, launch.world_size, is_master=False, timeout=timeout)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    store = _serve_store(listener, "127.0.0.1", launch.world_size, timeout)
    meeting.set("loopback_store_port", str(store.port))
    return store


def _own_store(launch: LaunchInfo, timeout: datetime.timedelta) -> dist.TCPStore:
    """The job's store, hosted by rank 0 and listening only on the rendezvous address (127.0.0.1 when every rank
    is on one host), not on every interface as TCPStore would: the failure records rank 0's summary trusts live
    there, and nobody else on the network should be able to write them. (When that address is not one of rank
    0's own, it listens on every interface, as TCPStore does.)"""
    if launch.init_method.startswith("tcp://"):
        address = urllib.parse.urlsplit(launch.init_method)
        host, port = address.hostname, address.port
        assert host is not None and port is not None  # launch.py writes tcp://host:port
    else:  # env://: ranks started by hand with MASTER_ADDR / MASTER_PORT
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if launch.rank != 0:
        return dist.TCPStore(host, port, launch.world_size, is_master=False, timeout=timeout)
    family, kind, protocol, _, bound_to = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    listener = socket.socket(family, kind, protocol)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind(bound_to)
    except OSError as exc:
        if exc.errno != errno.EADDRNOTAVAIL:
            raise
        listener.bind(("", port))  # the address is not one of this host's (a name behind NAT): every interface
    return _serve_store(listener, host, launch.world_size, timeout)


def _serve_store(listener: socket.socket, host: str, world_size: int, timeout: datetime.timedelta) -> dist.TCPStore:
    """Rank 0's store server on a socket rank 0 bound itself (TCPStore alone would listen on every interface)."""
    listener.listen(max(128, world_size))
    return dist.TCPStore(
        host,
        listener.getsockname()[1],
        world_size,
        is_master=True,
        timeout=timeout,
        wait_for_workers=False,  # init_process_group's own barrier waits for them, within the timeout
        master_listen_fd=listener.detach(),  # the store's server owns the socket from here
    )
