"""Loopback by default: on one host, every socket an spmd_rl rank listens on is bound to a loopback address (the
job's store, gloo's pairs), so no other machine can reach the store whose failure records rank 0's summary trusts.
Ranks started by hand (RANK, WORLD_SIZE, MASTER_ADDR=127.0.0.1), as mpirun's and srun's ranks rendezvous too; and
under torchrun, where the agent's store listens on every interface, the job's store is still rank 0's own on
loopback."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from harness.launch import free_port as _free_port

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(shutil.which("ss") is None, reason="needs iproute2's ss to list listening sockets")


def listeners(pids: list[int]) -> list[str]:
    """'address:port' of every TCP socket these processes listen on."""
    table = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    return [line.split()[3] for line in table.splitlines() if any(f"pid={pid}," in line for pid in pids)]


def test_a_one_host_job_listens_only_on_loopback(tmp_path):
    port = str(_free_port())
    procs = []
    for rank in range(2):
        env = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE="2",
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
            PYTHONPATH=str(ROOT),
        )
        env.pop("GLOO_SOCKET_IFNAME", None)  # the framework chooses loopback itself on one host
        command = [sys.executable, "-m", "spmd_rl.main", "--config", str(ROOT / "configs" / "ci_tiny.yaml")]
        command += ["train.total_steps=10000000", f"run.dir={tmp_path / 'run'}", "log.tensorboard=false"]
        procs.append(subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    try:
        deadline = time.monotonic() + 120
        while (
            not (tmp_path / "run" / "metrics.jsonl").exists() or not (tmp_path / "run" / "metrics.jsonl").stat().st_size
        ):
            assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, procs[0].stderr.read()
            time.sleep(0.2)
        bound = listeners([p.pid for p in procs])
        assert any(address.endswith(f":{port}") for address in bound), bound  # the store, on rank 0
        exposed = [a for a in bound if not (a.startswith("127.") or a.startswith("[::1]"))]
        assert not exposed, f"listening beyond loopback: {exposed} (all: {bound})"
    finally:
        for p in procs:
            p.kill()
            p.communicate()


def test_under_torchrun_on_one_host_the_job_store_is_our_own_on_loopback(monkeypatch):
    # torchrun's agent hosts a store on every interface (as TCPStore does) and its workers met there: a client from
    # anywhere on the network could write the failure records rank 0's summary trusts. On one host the ranks now
    # meet there only to learn the port of a store rank 0 hosts on 127.0.0.1.
    import datetime
    import threading

    import torch.distributed as dist

    from spmd_rl.runtime.job_store import open_rendezvous
    from spmd_rl.runtime.launch import LaunchInfo

    agent = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    for name, value in dict(
        TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_USE_AGENT_STORE="True", MASTER_ADDR="127.0.0.1"
    ).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MASTER_PORT", str(agent.port))
    stores = {}

    def meet(rank: int) -> None:
        launch = LaunchInfo("torchrun", rank=rank, world_size=2, local_rank=rank, local_world_size=2, init_method="")
        stores[rank] = open_rendezvous(launch, datetime.timedelta(seconds=30))["store"]

    threads = [threading.Thread(target=meet, args=(rank,)) for rank in (1, 0)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert sorted(stores) == [0, 1]
    port = stores[0].port
    assert port != agent.port and stores[1].port == port
    stores[1].set("spmd_rl/failure/rank1", "record")
    assert stores[0].get("spmd_rl/failure/rank1") == b"record" and not agent.check(["spmd_rl/failure/rank1"])
    assert f"127.0.0.1:{port}" in listeners([os.getpid()])
    # Ranks on several hosts keep meeting in the agent's store (under a prefix per restart).
    launch = LaunchInfo("torchrun", rank=1, world_size=4, local_rank=1, local_world_size=2, init_method="")
    shared = open_rendezvous(launch, datetime.timedelta(seconds=30))["store"]
    shared.set("key", "value")
    assert agent.get("spmd_rl/attempt_0/key") == b"value"
