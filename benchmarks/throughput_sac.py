"""CPU time of SAC's learning on Pendulum-v1: spmd_rl (one process) against Stable-Baselines3 with the same
hyperparameters.

    python benchmarks/throughput_sac.py [--steps 3000] [--repeats 2] [--compare-tree DIR]

Both run configs/sac_pendulum.yaml's settings: 1 env, 1000 uniform random steps, then 8 env steps and 8 gradient
steps in turn (batch 256, 256x256 ReLU actor and twin critics, tau 0.005, gamma 0.99, temperature tuned from 0.2),
with one learning rate for everything (SB3 has one: 3e-4, so spmd_rl's q_lr is set to it). SB3 updates the actor at
every gradient step, spmd_rl (as CleanRL) twice every second step: the same number of actor steps.

Measured from the first step after learning starts to the end of the run, so start-up and the random steps stay
out: env steps per second of the process's CPU time (the ratio is the table's answer) and of wall time, one torch
thread each. --compare-tree DIR adds the spmd_rl of another checkout (e.g. `git worktree add /tmp/old <commit>`),
run alternately with this one: a change's before and after in one run.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
from common import machine, run_spmd, table

LEARNING_STARTS = 1000
SEGMENT = 8  # env steps per iteration (algo.num_steps), and SB3's train_freq and gradient_steps
SPMD_OVERRIDES = ["algo.q_lr=0.0003"]


def sb3_sps(steps: int, seed: int) -> tuple[float, float]:
    """(SPS over wall time, SPS over CPU time) of SB3's learn() after learning_starts."""
    from stable_baselines3 import SAC
    from stable_baselines3.common.callbacks import BaseCallback

    torch.set_num_threads(1)

    class LearningClock(BaseCallback):
        """The clocks when the last random step is taken: learning starts after it."""

        def _on_step(self) -> bool:
            if self.num_timesteps == LEARNING_STARTS:
                self.start = (self.num_timesteps, time.perf_counter(), time.process_time())
            return True

    model = SAC(
        "MlpPolicy",
        "Pendulum-v1",
        learning_rate=3e-4,
        buffer_size=100_000,
        learning_starts=LEARNING_STARTS,
        batch_size=256,
        tau=0.005,
        gamma=0.99,
        train_freq=(SEGMENT, "step"),
        gradient_steps=SEGMENT,
        ent_coef="auto_0.2",
        policy_kwargs=dict(net_arch=[256, 256]),
        seed=seed,
        device="cpu",
    )
    clock = LearningClock()
    model.learn(total_timesteps=steps, callback=clock)
    wall, cpu = time.perf_counter(), time.process_time()
    first_step, first_wall, first_cpu = clock.start
    learned = model.num_timesteps - first_step
    return learned / (wall - first_wall), learned / (cpu - first_cpu)


def spmd_sps(steps: int, seed: int, root: Path | None = None) -> tuple[float, float]:
    """(SPS over wall time, SPS over CPU time) of spmd_rl after its last iteration of random steps only (the
    iteration that reaches learning_starts already learns)."""
    overrides = SPMD_OVERRIDES + [f"train.total_steps={steps}", f"train.seed={seed}"]
    records = run_spmd(overrides, config="configs/sac_pendulum.yaml", **({"root": root} if root else {}))
    first = next(r for r in records if r["env_steps"] >= LEARNING_STARTS - SEGMENT)
    learned = records[-1]["env_steps"] - first["env_steps"]
    return learned / (records[-1]["wall_s"] - first["wall_s"]), learned / (records[-1]["cpu_s"] - first["cpu_s"])


def compare_with_sb3(steps: int, repeats: int, other_tree: Path | None) -> None:
    ours, theirs, other = [], [], []
    loads = [os.getloadavg()[0]]
    for repeat in range(repeats):  # alternating, so a change in the machine's load hits every side alike
        trees = [(ours, None), (other, other_tree)] if other_tree else [(ours, None)]
        first, *rest = trees if repeat % 2 == 0 else trees[::-1]
        first[0].append(spmd_sps(steps, seed=1, root=first[1]))
        theirs.append(sb3_sps(steps, seed=1))
        for results, root in rest:
            results.append(spmd_sps(steps, seed=1, root=root))
    loads.append(os.getloadavg()[0])
    (wall_ours, cpu_ours), (wall_theirs, cpu_theirs) = _best(ours), _best(theirs)
    row = [
        steps - LEARNING_STARTS,
        f"{loads[0]:.1f} -> {loads[1]:.1f}",
        f"{cpu_theirs:.1f}",
        f"{cpu_ours:.1f}",
        f"{cpu_ours / cpu_theirs:.2f}x",
        f"{wall_theirs:.1f}",
        f"{wall_ours:.1f}",
        f"{wall_ours / wall_theirs:.2f}x",
    ]
    headers = [
        "learning steps",
        "load average",
        "SB3 SPS (CPU)",
        "spmd_rl SPS (CPU)",
        "ratio (CPU)",
        "SB3 SPS",
        "spmd_rl SPS",
        "ratio",
    ]
    if other_tree:
        wall_other, cpu_other = _best(other)
        row += [f"{cpu_other:.1f}", f"{cpu_other / cpu_theirs:.2f}x", f"{wall_other / wall_theirs:.2f}x"]
        headers += [f"{other_tree} SPS (CPU)", "its ratio (CPU)", "its ratio"]
    print(f"best of {repeats} runs each, alternating; env steps per second after learning starts")
    print(table(headers, [row]))


def _best(results: list[tuple[float, float]]) -> tuple[float, float]:
    return max(r[0] for r in results), max(r[1] for r in results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3000, help="env steps per run (the first 1000 random)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--compare-tree", type=Path, default=None, help="another checkout to measure alongside")
    args = parser.parse_args()
    print(f"machine: {machine()}")
    compare_with_sb3(args.steps, args.repeats, args.compare_tree)


if __name__ == "__main__":
    main()
