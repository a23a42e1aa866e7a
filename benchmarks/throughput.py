"""Env steps per second of a full PPO run: spmd_rl against Stable-Baselines3 with the same hyperparameters, and the
split layout's scaling with the number of env ranks on a slow env.

    python benchmarks/throughput.py [--parts sb3,scaling] [--compare-tree DIR]

--compare-tree DIR adds the spmd_rl of another checkout (e.g. `git worktree add /tmp/old <commit>`) to the SB3
table, run alternately with this one: a refactor's before and after, measured in one run.

SPS is measured over training (spmd_rl: env steps / wall_s of its last metrics record; SB3: timesteps / the
duration of learn()), both with one torch thread, on CartPole-v1. Scaling: split layouts with 1 trainer,
1 inference and k env ranks, each env rank one SlowCartPole (5 ms sleep per step), SPS after the first iteration
(start-up excluded); linear = k x the 1-rank SPS.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from common import SPLIT_ONE_ENV_PER_RANK, machine, run_spmd, table

SETTINGS = {
    # name: (SB3 PPO kwargs, spmd_rl overrides, budget)
    "rl-zoo tuned (8x32, 20 epochs, batch 256)": (
        dict(
            n_envs=8,
            n_steps=32,
            batch_size=256,
            n_epochs=20,
            gamma=0.98,
            gae_lambda=0.8,
            learning_rate=1e-3,
            clip_range=0.2,
            ent_coef=0.0,
        ),
        [
            "env.num_envs=8",
            "algo.num_steps=32",
            "algo.num_minibatches=1",
            "algo.update_epochs=20",
            "algo.gamma=0.98",
            "algo.gae_lambda=0.8",
            "algo.learning_rate=1e-3",
            "algo.clip_coef=0.2",
            "algo.anneal_lr=false",
            "algo.anneal_clip=false",
        ],
        51_200,
    ),
    "sb3 defaults (1x2048, 10 epochs, batch 64)": (
        dict(
            n_envs=1,
            n_steps=2048,
            batch_size=64,
            n_epochs=10,
            gamma=0.99,
            gae_lambda=0.95,
            learning_rate=3e-4,
            clip_range=0.2,
            ent_coef=0.0,
        ),
        [
            "env.num_envs=1",
            "algo.num_steps=2048",
            "algo.num_minibatches=32",
            "algo.update_epochs=10",
            "algo.gamma=0.99",
            "algo.gae_lambda=0.95",
            "algo.learning_rate=3e-4",
            "algo.clip_coef=0.2",
            "algo.anneal_lr=false",
            "algo.anneal_clip=false",
        ],
        40_960,
    ),
}


def sb3_sps(kwargs: dict, budget: int) -> tuple[float, float]:
    """(SPS over wall time, SPS over CPU time) of SB3's learn()."""
    from stable_baselines3 import PPO
    from stable_baselines3.common.env_util import make_vec_env

    torch.set_num_threads(1)
    kwargs = dict(kwargs)
    env = make_vec_env("CartPole-v1", n_envs=kwargs.pop("n_envs"), seed=1)
    model = PPO("MlpPolicy", env, seed=1, device="cpu", **kwargs)
    start, start_cpu = time.perf_counter(), time.process_time()
    model.learn(total_timesteps=budget)
    return (
        model.num_timesteps / (time.perf_counter() - start),
        model.num_timesteps / (time.process_time() - start_cpu),
    )


def spmd_sps(
    overrides: list[str], budget: int, nproc: int = 0, steady: bool = False, root: Path | None = None
) -> tuple[float, float]:
    """(SPS over wall time, SPS over rank 0's CPU time) of training. steady: from the end of the first iteration
    on, leaving out start-up (channel handshakes, the first weight broadcast), which grows with the ranks."""
    records = run_spmd(overrides + [f"train.total_steps={budget}"], nproc=nproc, **({"root": root} if root else {}))
    first = records[0] if steady else {"env_steps": 0, "wall_s": 0.0, "cpu_s": 0.0}
    steps = records[-1]["env_steps"] - first["env_steps"]
    return steps / (records[-1]["wall_s"] - first["wall_s"]), steps / (records[-1]["cpu_s"] - first["cpu_s"])


def compare_with_sb3(repeats: int, other_tree: Path | None = None) -> None:
    rows = []
    for name, (sb3_kwargs, overrides, budget) in SETTINGS.items():
        ours, theirs, other = [], [], []
        for repeat in range(repeats):  # alternating, so a change in the machine's load hits every side alike
            # ...and in turn first and last, so neither tree always follows SB3's in-process run
            trees = [(ours, None), (other, other_tree)] if other_tree else [(ours, None)]
            first, *rest = trees if repeat % 2 == 0 else trees[::-1]
            first[0].append(spmd_sps(overrides, budget, root=first[1]))
            theirs.append(sb3_sps(sb3_kwargs, budget))
            for results, root in rest:
                results.append(spmd_sps(overrides, budget, root=root))
        (wall_ours, cpu_ours), (wall_theirs, cpu_theirs) = _best(ours), _best(theirs)
        row = [
            name,
            budget,
            f"{wall_theirs:.0f}",
            f"{wall_ours:.0f}",
            f"{wall_ours / wall_theirs:.2f}x",
            f"{cpu_theirs:.0f}",
            f"{cpu_ours:.0f}",
            f"{cpu_ours / cpu_theirs:.2f}x",
        ]
        if other_tree:
            wall_other, cpu_other = _best(other)
            row += [f"{wall_other:.0f}", f"{wall_other / wall_theirs:.2f}x", f"{cpu_other / cpu_theirs:.2f}x"]
        rows.append(row)
    print("best of", repeats, "runs each, alternating; SPS over wall time, and over the process's CPU time")
    headers = [
        "settings",
        "env steps",
        "SB3 SPS",
        "spmd_rl SPS",
        "ratio",
        "SB3 SPS (CPU)",
        "spmd_rl SPS (CPU)",
        "ratio (CPU)",
    ]
    if other_tree:
        headers += [f"{other_tree} SPS", "its ratio", "its ratio (CPU)"]
    print(table(headers, rows))


def _best(results: list[tuple[float, float]]) -> tuple[float, float]:
    return max(r[0] for r in results), max(r[1] for r in results)


def split_scaling() -> None:
    rows = []
    base = None
    for env_ranks in (1, 2, 4):
        overrides = [
            "env.id=benchmarks.slow_env:SlowCartPole-v1",
            *SPLIT_ONE_ENV_PER_RANK,
            f"layout.env={env_ranks}",
        ]
        sps, _ = spmd_sps(overrides, budget=64 * env_ranks * 16, nproc=2 + env_ranks, steady=True)
        base = base or sps
        rows.append(
            [env_ranks, 2 + env_ranks, f"{sps:.0f}", f"{base * env_ranks:.0f}", f"{sps / (base * env_ranks):.2f}"]
        )
    print(table(["env ranks", "world size", "SPS", "linear (k x 1-rank SPS)", "vs linear"], rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="sb3,scaling")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--compare-tree", type=Path, default=None, help="another checkout to measure alongside")
    args = parser.parse_args()
    print(f"machine: {machine()}")
    if "sb3" in args.parts:
        compare_with_sb3(args.repeats, args.compare_tree)
    if "scaling" in args.parts:
        split_scaling()


if __name__ == "__main__":
    main()
