"""What checkpoints cost a run: the same run with a checkpoint after every iteration and with one only at the end,
alternating, in one process.

    python benchmarks/checkpoint_cost.py [--repeats 3]

Reports wall seconds per iteration (rank 0's wall_s / iterations) both ways; the difference is the cost of one
checkpoint (every rank's file written, fsynced and renamed, then committed). A real run checkpoints every
checkpoint.every_s seconds (default 600), so its overhead is this cost once per ten minutes.
"""

from __future__ import annotations

import argparse

from common import machine, run_spmd, table

RUNS = {
    # name: (config, overrides, iterations)
    "PPO CartPole (8 envs x 32 steps, 20 epochs)": (None, ["train.total_steps=25600", "algo.num_minibatches=1"], 100),
    "SAC Pendulum (8 steps, 256x256, 100k replay)": (
        "configs/sac_pendulum.yaml",
        ["train.total_steps=4000", "algo.learning_starts=1000"],
        500,
    ),
}


def seconds_per_iteration(config, overrides, iterations, every: int) -> float:
    records = run_spmd(overrides + [f"checkpoint.every_iterations={every}", "checkpoint.every_s=0"], config=config)
    assert len(records) == iterations
    return records[-1]["wall_s"] / iterations


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"machine: {machine()}")
    rows = []
    for name, (config, overrides, iterations) in RUNS.items():
        every, end_only = [], []
        for _ in range(args.repeats):  # alternating: a change in the machine's load hits both alike
            every.append(seconds_per_iteration(config, overrides, iterations, every=1))
            end_only.append(seconds_per_iteration(config, overrides, iterations, every=0))
        per_every, per_end = min(every), min(end_only)
        rows.append(
            [
                name,
                iterations,
                f"{per_end * 1000:.1f}",
                f"{per_every * 1000:.1f}",
                f"{(per_every - per_end) * 1000:.1f}",
                f"{per_every / per_end:.2f}x",
            ]
        )
    print(f"best of {args.repeats}, alternating; ms per iteration")
    print(
        table(
            [
                "run",
                "iterations",
                "checkpoint at the end only",
                "checkpoint every iteration",
                "cost of one checkpoint (ms)",
                "ratio",
            ],
            rows,
        )
    )


if __name__ == "__main__":
    main()
