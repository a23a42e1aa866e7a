"""MetaWorld from pixels: steps per second of an env rank's vector env (`metaworld/<task>` through make_vector_env,
as the env runner steps it: the Dict observation, the instruction's token ids, action clipping, episode
statistics) against the raw loop it is built on (one MetaWorld env: set_task, step, render the camera at the same
size with the same cheap scene), both with random actions, alternated in rounds in one process.

    python benchmarks/metaworld_envs.py [--task reach-v3] [--envs 1 4] [--size 64] [--seconds 10] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
from common import ROOT, machine, table

sys.path[:0] = [str(ROOT)]
from spmd_rl.config.loading import load_config  # noqa: E402
from spmd_rl.envs.metaworld_envs import choose_renderer, make_task_env, metaworld_benchmark  # noqa: E402
from spmd_rl.envs.vector import make_vector_env, probe_env  # noqa: E402


def raw_loop(task: str, size: int, seconds: float) -> float:
    """One MetaWorld env stepped and rendered in a plain loop: the floor an env rank's envs are measured against."""
    benchmark = metaworld_benchmark(task, 0)
    env = make_task_env(benchmark.train_classes[task], "corner2", size, size, cheap_scene=True)
    rng = np.random.default_rng(0)
    env.set_task(benchmark.train_tasks[0])
    env.reset()
    env.render()  # the first frame uploads the scene to the GL context: outside the timing, as the vector env's reset
    steps, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        _, _, terminated, truncated, _ = env.step(rng.uniform(-1, 1, 4).astype(np.float32))
        env.render()
        steps += 1
        if terminated or truncated:
            env.set_task(benchmark.train_tasks[steps % 50])
            env.reset()
    rate = steps / (time.perf_counter() - start)
    env.close()
    return rate


def vector_env(task: str, num_envs: int, size: int, seconds: float) -> float:
    """Steps per second (over all envs) of an env rank's vector env of num_envs MetaWorld envs."""
    cfg = load_config(
        None, [f"env.id=metaworld/{task}", f"env.num_envs={num_envs}", f"env.kwargs={{width: {size}, height: {size}}}"]
    ).env
    envs, _ = make_vector_env(cfg, probe_env(cfg), seed=0)
    rng = np.random.default_rng(0)
    steps, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        envs.step(rng.uniform(-1, 1, (num_envs, 4)).astype(np.float32))
        steps += num_envs
    rate = steps / (time.perf_counter() - start)
    envs.close()
    return rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="reach-v3")
    parser.add_argument("--envs", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--size", type=int, default=64, help="image width and height")
    parser.add_argument("--seconds", type=float, default=10.0, help="time per measurement")
    parser.add_argument("--rounds", type=int, default=3, help="raw and vector measurements alternate this often")
    args = parser.parse_args()
    print(f"renderer: MUJOCO_GL={choose_renderer()}")
    raw: list[float] = []
    vector: dict[int, list[float]] = {n: [] for n in args.envs}
    for _ in range(args.rounds):
        raw.append(raw_loop(args.task, args.size, args.seconds))
        for num_envs in args.envs:
            vector[num_envs].append(vector_env(args.task, num_envs, args.size, args.seconds))
    floor = statistics.median(raw)
    rows = [["raw env + render (one env)", 1, f"{floor:.1f}", "1.00"]]
    for num_envs, rates in vector.items():
        rate = statistics.median(rates)
        rows.append([f"env rank's vector env (metaworld/{args.task})", num_envs, f"{rate:.1f}", f"{rate / floor:.2f}"])
    print(machine())
    print(f"{args.size}x{args.size} pixels, median of {args.rounds} rounds of {args.seconds:.0f} s each")
    print(table(["what steps", "envs", "steps/s", "vs raw"], rows))


if __name__ == "__main__":
    main()
