"""Randomized kill -9 trials (issue 19, item 1): a run killed at a random moment, then rerun with the same command,
must resume and finish with exactly the result of an uninterrupted run.

Each case runs once uninterrupted (the reference), then `--trials` times: start the run, wait a random time drawn
uniformly between its first metrics record and 0.7 of the reference's duration (checkpoints are taken every
iteration, so kills land before, during and after checkpoint commits), kill -9 one rank (one process: the
process; split 4: a random rank, then the rest, as a launcher would), rerun the same command until it exits 0,
and compare metrics.jsonl (timings aside) and the final weights with the reference.

    python benchmarks/kill9.py --trials 10 --cases ppo_log_one sac_hdf5_one ppo_log_split4
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import free_port

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "configs" / "ci_tiny.yaml")
SPLIT4 = ["layout.mode=split", "layout.trainer=1", "layout.inference=1", "layout.env=2"]
COMMON = ["checkpoint.every_iterations=1", "log.progress=false", "log.tensorboard=false"]
CASES = {
    "ppo_log_one": (["--config", TINY, "train.total_steps=2048", "buffer.log_experience=true"], 1),
    "sac_hdf5_one": (
        [
            "--config",
            str(ROOT / "configs" / "sac_pendulum.yaml"),
            "algo.num_steps=4",
            "train.total_steps=600",
            "algo.learning_starts=64",
            "algo.batch_size=32",
            "policy.hidden_sizes=[16,16]",
            "algo.critic_hidden_sizes=[16,16]",
            "buffer.backend=hdf5",
        ],
        1,
    ),
    "ppo_log_split4": (["--config", TINY, "train.total_steps=2048", "buffer.log_experience=true", *SPLIT4], 4),
}
TIMINGS = ("sps", "wall_s", "cpu_s")


def start(args: list[str], run_dir: Path, world: int, port: int) -> list[subprocess.Popen]:
    """The run's processes, started by hand as a launcher would (world 1: one process)."""
    procs = []
    for rank in range(world):
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
        if world > 1:
            env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        command = [sys.executable, "-m", "spmd_rl.main", *args, *COMMON, f"run.dir={run_dir}"]
        procs.append(subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    return procs


def wait(procs: list[subprocess.Popen], timeout: float = 600) -> tuple[list[int], list[str]]:
    """Every process's exit code and the last line of its stderr."""
    deadline = time.monotonic() + timeout
    last_lines = []
    for p in procs:
        _, stderr = p.communicate(timeout=max(deadline - time.monotonic(), 1))
        last_lines.append((stderr or "").strip().splitlines()[-1:] or [""])
    return [p.returncode for p in procs], [line for (line,) in last_lines]


def records(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [
        {k: v for k, v in json.loads(line).items() if not k.startswith("time_") and k not in TIMINGS} for line in lines
    ]


def same_result(a: Path, b: Path) -> bool:
    pa, pb = torch.load(a / "policy.pt", weights_only=True), torch.load(b / "policy.pt", weights_only=True)
    return records(a) == records(b) and pa.keys() == pb.keys() and all(torch.equal(pa[k], pb[k]) for k in pa)


def first_record_time(run_dir: Path, procs: list[subprocess.Popen], timeout: float = 300) -> float:
    deadline = time.monotonic() + timeout
    metrics = run_dir / "metrics.jsonl"
    while not (metrics.exists() and metrics.stat().st_size):
        if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
            raise RuntimeError(f"the run ended or stalled before its first record: {procs[0].stderr.read()[-2000:]}")
        time.sleep(0.05)
    return time.monotonic()


def trial(args, world, reference: Path, duration: float, rng: random.Random, scratch: Path) -> tuple[bool, str]:
    run_dir = scratch / f"trial{rng.randrange(10**9)}"
    procs = start(args, run_dir, world, free_port())
    first = first_record_time(run_dir, procs)
    # Within the reference's duration less a margin: a rerun on a less loaded machine runs faster, and a kill after
    # its end tests nothing (measured: 8 of 15 kills drawn over the whole duration landed after the end).
    time.sleep(rng.uniform(0, 0.7 * duration))
    victim = rng.randrange(world)
    procs[victim].send_signal(signal.SIGKILL)
    time.sleep(0.5)
    for p in procs:  # what a launcher does after a rank dies: the others go too
        if p.poll() is None:
            p.kill()
    wait(procs)
    finished_first = (run_dir / "finished.json").exists()  # killed after the end: nothing to resume
    reruns, errors = 0, ""
    while not (run_dir / "finished.json").exists():
        if reruns == 3:
            return False, f"not finished after {reruns} reruns: {errors}"
        reruns += 1
        codes, last_lines = wait(start(args, run_dir, world, free_port()))
        if any(codes):
            errors = f"rerun {reruns} exited {codes}: {' | '.join(last_lines)}"
            print(f"  {run_dir}: {errors}", file=sys.stderr, flush=True)
    exact = same_result(reference, run_dir)
    note = f"killed rank {victim} {time.monotonic() - first:.1f}s in" + (
        " (after it finished)" if finished_first else ""
    )
    shutil.rmtree(run_dir, ignore_errors=True)
    return exact, note + ("" if exact else ": the result differs from the uninterrupted run")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--seed", type=int, default=0)
    options = parser.parse_args()
    rng = random.Random(options.seed)
    scratch = Path(tempfile.mkdtemp(prefix="spmd_kill9_"))
    print(f"load average at start: {os.getloadavg()}")
    print("| case | trials | resumed and finished | equal to the uninterrupted run |")
    print("|---|---|---|---|")
    for name in options.cases:
        args, world = CASES[name]
        reference = scratch / f"{name}_reference"
        procs = start(args, reference, world, free_port())
        began = time.monotonic()
        first = first_record_time(reference, procs)
        codes, last_lines = wait(procs)
        assert codes == [0] * world, last_lines
        duration = time.monotonic() - first
        finished = exact = 0
        for _ in range(options.trials):
            ok, note = trial(args, world, reference, duration, rng, scratch)
            finished += "not finished" not in note
            exact += ok
            print(f"  {name}: {'ok' if ok else 'FAILED'}: {note}", file=sys.stderr, flush=True)
        print(f"| {name} | {options.trials} | {finished} | {exact} |  (reference {time.monotonic() - began:.0f}s)")
    print(f"load average at end: {os.getloadavg()}")
    shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
