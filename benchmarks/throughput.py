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
from typing import NamedTuple

import torch
from common import SPLIT_ONE_ENV_PER_RANK, machine, run_spmd, table


class PPOSettings(NamedTuple):
    """One set of PPO hyperparameters, in SB3's names; both sides also clip at 0.2 with no entropy bonus and no
    annealing (SB3's constants)."""

    n_envs: int
    n_steps: int
    batch_size: int
    n_epochs: int
    gamma: float
    gae_lambda: float
    learning_rate: float

    def sb3_kwargs(self) -> dict:
        return dict(self._asdict(), clip_range=0.2, ent_coef=0.0)

    def overrides(self) -> list[str]:
        """The same settings for spmd_rl, which names a minibatch by how many split the rollout, not by its size."""
        rollout = self.n_envs * self.n_steps
        assert rollout % self.batch_size == 0, f"batch_size {self.batch_size} must divide the rollout's {rollout}"
        return [
            f"env.num_envs={self.n_envs}",
            f"algo.num_steps={self.n_steps}",
            f"algo.num_minibatches={rollout // self.batch_size}",
            f"algo.update_epochs={self.n_epochs}",
            f"algo.gamma={self.gamma}",
            f"algo.gae_lambda={self.gae_lambda}",
            f"algo.learning_rate={self.learning_rate}",
            "algo.clip_coef=0.2",
            "algo.anneal_lr=false",
            "algo.anneal_clip=false",
        ]


SETTINGS = {
    # name: (settings, env steps)
    "rl-zoo tuned (8x32, 20 epochs, batch 256)": (PPOSettings(8, 32, 256, 20, 0.98, 0.8, 1e-3), 51_200),
    "sb3 defaults (1x2048, 10 epochs, batch 64)": (PPOSettings(1, 2048, 64, 10, 0.99, 0.95, 3e-4), 40_960),
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
    for name, (settings, budget) in SETTINGS.items():
        sb3_kwargs, overrides = settings.sb3_kwargs(), settings.overrides()
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
