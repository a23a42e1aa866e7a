"""torch's C++ log below errors is off in spmd_rl's processes unless asked for: a rank still waiting in the job's
store when a peer's store closed printed c10d's "recvValueWithTimeout failed" warning and a 20-frame C++ stack
before its own line (fault pass 8, J3). The error itself still arrives, as the exception its line is made of."""

from __future__ import annotations

import subprocess
import sys

import pytest
from harness.launch import ROOT, free_port, job_env

# A store whose server ends while its one client waits in get(): the client's error comes from a closed socket.
SERVER = """
import datetime, sys, time
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), 2, True, timeout=datetime.timedelta(seconds=60))
time.sleep(3)  # the client, connected, now waits in get()
"""
# spmd_rl.main's entry point, its run replaced by that wait (torch imported inside it, as a run imports it late).
CLIENT = """
import sys
import spmd_rl.main as main

def waits_on_a_store_that_closes(argv):
    import datetime
    import torch.distributed as dist
    store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), 2, False, timeout=datetime.timedelta(seconds=60))
    try:
        store.get("never set")
    except dist.DistNetworkError as exc:
        print("the store closed:", type(exc).__name__, flush=True)
    return 0

main._main = waits_on_a_store_that_closes
sys.exit(main.main([]))
"""


@pytest.mark.parametrize("debug", ["", "1"], ids=["default", "SPMD_RL_DEBUG"])
def test_a_closed_store_is_an_error_without_torchs_cpp_warning_and_stack(debug):
    port = str(free_port())
    env = job_env(SPMD_RL_DEBUG=debug)
    env.pop("TORCH_CPP_LOG_LEVEL", None)
    server = subprocess.Popen([sys.executable, "-c", SERVER, port], cwd=ROOT, env=env)
    try:
        client = subprocess.run(
            [sys.executable, "-c", CLIENT, port], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
        )
    finally:
        server.wait(timeout=120)
    assert client.returncode == 0 and "the store closed: DistNetworkError" in client.stdout, client.stderr[-2000:]
    if debug:  # the warning is real: asked for, it comes
        assert "recvValueWithTimeout failed" in client.stderr and "frame #" in client.stderr
    else:
        assert "recvValueWithTimeout" not in client.stderr and "frame #" not in client.stderr, client.stderr[-2000:]
