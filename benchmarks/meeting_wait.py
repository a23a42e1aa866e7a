"""CPU seconds a rank spends waiting at the meeting before start (spmd_rl.runtime.meeting.meet), of this checkout and
(alternating) another one.

    python benchmarks/meeting_wait.py [--wait-s 30] [--compare-tree DIR]

Two processes meet in a TCPStore, as two ranks of a job do: in "rank 0 waits", rank 1 arrives --wait-s seconds
after rank 0 began to wait (a slow rank's checks); in "rank 1 waits", rank 0 arrives that late (rank 0's own checks).
The waiting rank's CPU time (time.process_time) over its meet is printed. DIR is another checkout (e.g. `git worktree
add --detach /tmp/old <commit>`), put on PYTHONPATH in turn.
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from common import ROOT, free_port

RANK = """
import datetime, sys, time
import torch.distributed as dist
from spmd_rl.runtime.meeting import meet
rank, port, late_s = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
store = dist.TCPStore("127.0.0.1", port, 3, False, timeout=datetime.timedelta(seconds=60))
time.sleep(late_s)
before = time.process_time()
meet(store, rank, 2, datetime.timedelta(seconds=300))
print(f"{time.process_time() - before:.3f}")
"""


def waiting_cpu_s(tree: Path, waiting_rank: int, wait_s: float) -> float:
    """The waiting rank's CPU seconds over its meet; the ranks run in a scratch directory, outside any checkout
    (`-c` looks in the working directory before PYTHONPATH)."""
    import torch.distributed as dist

    port = free_port()
    timeout = datetime.timedelta(seconds=60)
    server = dist.TCPStore("127.0.0.1", port, 3, True, timeout=timeout, wait_for_workers=False)
    env = {**os.environ, "PYTHONPATH": str(tree)}
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", RANK, str(rank), str(port), str(0.0 if rank == waiting_rank else wait_s)],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            cwd=tempfile.gettempdir(),
        )
        for rank in (0, 1)
    ]
    said = [rank.communicate(timeout=wait_s + 120)[0] for rank in ranks]
    del server
    return float(said[waiting_rank])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wait-s", type=float, default=30.0)
    parser.add_argument("--compare-tree", type=Path, help="another checkout, measured alternating with this one")
    options = parser.parse_args()
    trees = [("this checkout", ROOT)] + ([("compared", options.compare_tree)] if options.compare_tree else [])
    for waiting_rank in (0, 1):
        for name, tree in trees:
            cpu = waiting_cpu_s(tree, waiting_rank, options.wait_s)
            print(
                f"{name}: rank {waiting_rank} waits {options.wait_s:g} s: {cpu:.3f} CPU s (load "
                f"{os.getloadavg()[0]:.1f})",
                flush=True,
            )


if __name__ == "__main__":
    main()
