"""GRPO on examples/instructed_reach: the success rate reached with the instruction, and with it blanked.

    python benchmarks/instructed_reach.py [--seeds 3] [--layouts one,split5] [--configs grpo,ppo] [--blank] [--steps N]

Runs the example's grpo.yaml (env.action_chunk 4, env.group_size 8, 32 envs in all in every layout; `--configs
grpo,ppo` also its ppo.yaml, the same env and chunks without groups) with its folder importable, per seed and
layout. `--blank` adds the control, the same runs with
env.kwargs.blank_instruction=true: every instruction reads "reach the target", so a policy can only pick one of
the three targets (about 1/3 success). Success is the per-iteration success_rate (32 whole episodes an iteration)
averaged over WINDOW iterations: "steps to 0.9" is the first iteration where that average reaches 0.9, "final" is
its value at the end of the budget. Not episode_return_mean: with whole-episode rollouts the last 20 episodes to
end in an iteration are its longest ones, the failures.
"""

from __future__ import annotations

import argparse
import os

from common import ROOT, machine, run_spmd, table

FOLDER = ROOT / "examples" / "instructed_reach"
TARGET = 0.9
WINDOW = 5  # iterations (160 episodes) per success average
# layout: (torchrun processes (0 = plain python), overrides); 32 envs in all in each
LAYOUTS = {
    "one": (0, []),
    "split5": (
        5,
        ["layout.mode=split", "layout.trainer=2", "layout.inference=1", "layout.env=2", "env.num_envs=16"],
    ),
    "split5-fsdp": (
        5,
        ["layout.mode=split", "layout.trainer=2", "layout.inference=1", "layout.env=2", "env.num_envs=16"]
        + ["train.parallel=fsdp"],
    ),
}


def windowed_success(records: list[dict]) -> list[tuple[int, float]]:
    """(env steps, mean success_rate over the last WINDOW iterations) from the WINDOW-th iteration on."""
    rates = [r["success_rate"] or 0.0 for r in records]
    return [
        (records[i]["env_steps"], sum(rates[i + 1 - WINDOW : i + 1]) / WINDOW) for i in range(WINDOW - 1, len(records))
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--layouts", default="one")
    parser.add_argument("--configs", default="grpo", help="the example's configs to run: grpo, ppo or both")
    parser.add_argument("--blank", action="store_true", help="also run every seed with the instruction blanked")
    parser.add_argument("--steps", type=int, help="train.total_steps (default: the config's)")
    args = parser.parse_args()
    print(f"machine: {machine()}; load average at start {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    rows = []
    for layout, config in [
        (layout, config) for layout in args.layouts.split(",") for config in args.configs.split(",")
    ]:
        nproc, overrides = LAYOUTS[layout]
        for instruction in ["read", "blanked"] if args.blank else ["read"]:
            blank = ["env.kwargs.blank_instruction=true"] if instruction == "blanked" else []
            for seed in range(1, args.seeds + 1):
                budget = [f"train.total_steps={args.steps}"] if args.steps else []
                records = run_spmd(
                    [*overrides, *blank, *budget, f"train.seed={seed}"],
                    nproc=nproc,
                    config=str(FOLDER / f"{config}.yaml"),
                    user_code=FOLDER,
                )
                success = windowed_success(records)
                reached = next((steps for steps, rate in success if rate >= TARGET), None)
                rows.append(
                    [
                        layout,
                        config,
                        instruction,
                        seed,
                        records[-1]["env_steps"],
                        f"{success[-1][1]:.2f}",
                        f"{max(rate for _, rate in success):.2f}",
                        reached if reached is not None else "not reached",
                        f"{records[-1]['wall_s']:.0f}",
                    ]
                )
                print(
                    f"{layout} {config} {instruction} seed {seed} done; load average {os.getloadavg()[0]:.2f}",
                    flush=True,
                )
    headers = [
        "layout",
        "config",
        "instruction",
        "seed",
        "env steps",
        "final success",
        "best success",
        "steps to 0.9",
        "wall s",
    ]
    print(table(headers, rows))


if __name__ == "__main__":
    main()
