"""Loopback by default: on one host, every socket an spmd_rl rank listens on is bound to a loopback address (the
job's store, gloo's pairs), so no other machine can reach the store whose failure records rank 0's summary trusts.
Ranks started by hand (RANK, WORLD_SIZE, MASTER_ADDR=127.0.0.1), as mpirun's and srun's ranks rendezvous too."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(shutil.which("ss") is None, reason="needs iproute2's ss to list listening sockets")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
