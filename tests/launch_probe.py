"""The smallest SPMD program: detect the launch, join the process group, all_reduce, report, exit 0.

    <launcher> python tests/launch_probe.py OUT_DIR

Each rank writes OUT_DIR/rank<N>.json with what it detected and the all_reduce result, so a test can check a
launcher end to end in seconds, without training anything.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from spmd_rl.launch import detect_launch
from spmd_rl.runtime import shutdown_runtime, start_runtime, wait


def main(out_dir: Path) -> None:
    launch = detect_launch()
    runtime = start_runtime(launch, "cpu", timeout_s=30)
    total = torch.tensor([float(launch.rank + 1)])
    if runtime.distributed:
        work = dist.all_reduce(total, async_op=True)
        wait(work, runtime.timeout, lambda: f"rank {launch.rank}: all_reduce over all {launch.world_size} ranks")
    report = {"launcher": launch.launcher, "rank": launch.rank, "world_size": launch.world_size,
              "local_rank": launch.local_rank, "local_world_size": launch.local_world_size,
              "init_method": launch.init_method, "rank_sum": total.item()}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"rank{launch.rank}.json").write_text(json.dumps(report))
    shutdown_runtime(runtime, 0)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
