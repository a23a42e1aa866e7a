"""The smallest SPMD program: detect the launch, join the process group, all_reduce, report, exit 0.

    <launcher> python tests/harness/launch_probe.py [--config FILE] run.dir=OUT_DIR [other overrides]

It takes spmd_rl.main's arguments (and ignores all but run.dir), so a launch script can run it in main's place.
Each rank writes OUT_DIR/rank<N>.json with what it detected and the all_reduce result, so a test can check a
launcher end to end in seconds, without training anything.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from spmd_rl.runtime.distributed import shutdown_runtime, start_runtime, wait
from spmd_rl.runtime.launch import detect_launch


def main(out_dir: Path) -> None:
    launch = detect_launch()
    runtime = start_runtime(launch, "cpu", timeout_s=30)
    total = torch.tensor([float(launch.rank + 1)])
    if runtime.distributed:
        work = dist.all_reduce(total, async_op=True)
        wait(work, runtime.timeout, lambda: f"rank {launch.rank}: all_reduce over all {launch.world_size} ranks")
    report = {
        "launcher": launch.launcher,
        "rank": launch.rank,
        "world_size": launch.world_size,
        "local_rank": launch.local_rank,
        "local_world_size": launch.local_world_size,
        "init_method": launch.init_method,
        "rank_sum": total.item(),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"rank{launch.rank}.json").write_text(json.dumps(report))
    shutdown_runtime(runtime, 0)


if __name__ == "__main__":
    run_dirs = [arg.split("=", 1)[1] for arg in sys.argv[1:] if arg.startswith("run.dir=")]
    if not run_dirs:
        sys.exit("usage: launch_probe.py [--config FILE] run.dir=OUT_DIR [section.key=value ...]")
    main(Path(run_dirs[-1]))
