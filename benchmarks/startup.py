"""Start-up to the first iteration, one process, against `python -c "import torch"` on the same machine, in one run.

    python benchmarks/startup.py [--repeats 5]

Times, alternating the variants every repeat (medians over repeats):
- `import torch`: the floor every rank pays;
- `import torch, tensordict`: what tensordict adds (it imports torch._dynamo at import);
- `--help`: the command line without torch;
- first iteration: `python -m spmd_rl.main --config configs/ci_tiny.yaml` from launch to its first metrics line on
  stdout (log.interval_s=0 prints every iteration), in a fresh run directory;
- split 4 ranks: the same config under `torchrun --nproc_per_node=4` in the split layout (1 trainer, 1 inference,
  2 env ranks), launch to exit: what every multi-rank test and short job pays.
Each spmd_rl variant also runs "as before": tensordict imported ahead of spmd_rl, the way every rank imported it
before runtime/fast_imports.py (its import then pulls torch._dynamo).

    python benchmarks/startup.py --cpu [--repeats 5] [--compare-tree DIR]

CPU seconds (user + system, from the children's rusage) to exit instead, robust to a busy machine: `import torch`
and a one-iteration run of the default config (`train.total_steps=256`, TensorBoard on), of this checkout and,
alternating with it, of another one (e.g. `git worktree add --detach /tmp/old <commit>`).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def timed(command: list[str], until: str | None = None) -> float:
    """Seconds from launch to exit, or to the first stdout line starting with `until`."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    started = time.perf_counter()
    job = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    if until is not None:
        for line in job.stdout:
            if line.startswith(until):
                took = time.perf_counter() - started
                job.kill()
                job.communicate()
                return took
        raise RuntimeError(f"{command} ended without a line starting with {until!r}")
    job.communicate()
    return time.perf_counter() - started


def cpu_seconds(command: list[str], root: Path = ROOT) -> float:
    """CPU seconds (user + system) of a command run to its exit, with cwd and PYTHONPATH at root."""
    env = dict(os.environ, PYTHONPATH=str(root), OMP_NUM_THREADS="1")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(command, cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime


def print_medians(times: dict[str, list[float]], unit: str) -> None:
    """The table of each variant's median, and that minus the median of `import torch`; the load at the end."""
    floor = statistics.median(times["import torch"])
    print(f"| what | {unit} | minus `import torch` |")
    print("|---|---|---|")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"| {name} | {median:.2f} | {median - floor:+.2f} |")
    print(f"load average at end: {os.getloadavg()}")


def cpu_main(repeats: int, other: Path | None) -> None:
    python = sys.executable
    trees = {"this checkout": ROOT, **({str(other): other} if other else {})}
    times: dict[str, list[float]] = {"import torch": [], **{f"one iteration, {name}": [] for name in trees}}
    print(f"load average at start: {os.getloadavg()}")
    for _ in range(repeats):
        times["import torch"].append(cpu_seconds([python, "-c", "import torch"]))
        for name, root in trees.items():
            run_dir = f"run.dir={tempfile.mkdtemp(prefix='spmd_startup_')}/run"
            command = [python, "-m", "spmd_rl.main", "train.total_steps=256", "log.progress=false", run_dir]
            times[f"one iteration, {name}"].append(cpu_seconds(command, root))
    print_medians(times, "median CPU s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cpu", action="store_true", help="CPU seconds to exit (see above)")
    parser.add_argument("--compare-tree", type=Path, help="--cpu: another checkout, run alternately with this one")
    args = parser.parse_args()
    repeats = args.repeats
    if args.cpu:
        cpu_main(repeats, args.compare_tree)
        return
    python = sys.executable
    variants = {
        "import torch": ([python, "-c", "import torch"], None),
        "import torch, tensordict": ([python, "-c", "import torch, tensordict"], None),
        "spmd_rl --help": ([python, "-m", "spmd_rl.main", "--help"], None),
    }
    # The same program, or the same program after `import tensordict` (how every rank started before).
    as_before = [
        python,
        "-c",
        "import runpy, sys, tensordict; sys.argv[0] = 'spmd_rl'; runpy.run_module('spmd_rl.main', run_name='__main__')",
    ]
    torchrun = [str(Path(python).with_name("torchrun")), "--standalone", "--nproc_per_node=4"]
    split = ["layout.mode=split", "layout.trainer=1", "layout.inference=1", "layout.env=2"]
    for how, program, launcher in (
        ("", [python, "-m", "spmd_rl.main"], torchrun + ["-m", "spmd_rl.main"]),
        (", as before", as_before, torchrun + ["--no-python", *as_before]),
    ):
        config = ["--config", "configs/ci_tiny.yaml", "log.interval_s=0", "log.progress=false", "log.tensorboard=false"]
        variants[f"first iteration{how}"] = ([*program, *config], "iter ")
        variants[f"split 4 ranks, launch to exit{how}"] = ([*launcher, *config, *split], None)
    times: dict[str, list[float]] = {name: [] for name in variants}
    print(f"load average at start: {os.getloadavg()}")
    for _ in range(repeats):
        for name, (command, until) in variants.items():
            if "--config" in command:  # every run of spmd_rl in a fresh run directory
                command = [*command, f"run.dir={tempfile.mkdtemp(prefix='spmd_startup_')}/run"]
            times[name].append(timed(command, until))
    print_medians(times, "median s")


if __name__ == "__main__":
    main()
