"""Run a function on N real torch.distributed ranks (gloo, CPU) inside one pytest test.

Children are forked (a few hundredths of a second for 8 ranks, against seconds for torchrun) and meet through a
fresh `file://` store, so concurrent tests never fight over ports. A child reports through its exit code:
0 success, 1 any exception (its traceback goes to stderr, which pytest shows for a failing test), 3 a CommError.
Children check their own results (assert inside fn) or torch.save them into a directory the test passes in.
Modules that are slow to import (torch.optim pulls in torch._dynamo: seconds) are best imported by the parent
before run_ranks, so each child inherits them instead of importing them again.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist

from spmd_rl.runtime.errors import COMM_ERROR_EXIT_CODE, CommError

KILLED = -9  # the exit code run_ranks reports for a child it had to kill at the deadline


def run_ranks(
    fn: Callable, world_size: int, *args, timeout_s: float = 60.0, deadline_s: float | None = None
) -> list[int]:
    """Run fn(rank, world_size, *args) on world_size forked ranks; return their exit codes in rank order.

    timeout_s is the process group's timeout (the bound on every collective and wait inside fn). deadline_s bounds
    the whole run from the parent's side (default: twice the timeout plus 10 s); children still alive then are
    killed and reported as KILLED, so a hanging test fails instead of hanging pytest.
    """
    deadline_s = 2 * timeout_s + 10 if deadline_s is None else deadline_s
    store_dir = tempfile.mkdtemp(prefix="spmd_rl_store_")
    init_method = "file://" + os.path.join(store_dir, "store")
    context = multiprocessing.get_context("fork")
    children = [
        context.Process(target=_child, args=(fn, rank, world_size, init_method, timeout_s, args), daemon=True)
        for rank in range(world_size)
    ]
    try:
        for child in children:
            child.start()
        give_up_at = time.monotonic() + deadline_s
        for child in children:
            child.join(max(0.0, give_up_at - time.monotonic()))
        for child in children:
            if child.is_alive():
                child.kill()
                child.join()
        return [KILLED if child.exitcode is None else child.exitcode for child in children]
    finally:
        shutil.rmtree(store_dir, ignore_errors=True)


def assert_all_ok(codes: list[int]) -> None:
    """Every rank exited 0; otherwise say which did not (their tracebacks are in the captured stderr)."""
    failed = {rank: code for rank, code in enumerate(codes) if code != 0}
    assert not failed, f"ranks failed (rank: exit code): {failed}; all codes {codes}"


def _child(fn: Callable, rank: int, world_size: int, init_method: str, timeout_s: float, args: tuple) -> None:
    # Forked from pytest: leave through os._exit so no inherited atexit or pytest machinery runs twice.
    code = 0
    try:
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
        torch.set_num_threads(1)  # N ranks share 2 cores; intra-op threads would only fight each other
        dist.init_process_group(
            "gloo",
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        fn(rank, world_size, *args)
        dist.destroy_process_group()
    except CommError:
        traceback.print_exc()
        code = COMM_ERROR_EXIT_CODE
    except BaseException:  # noqa: BLE001 - any failure of the child is reported through its exit code
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
