"""GRPO on examples/instructed_reach: the success rate reached with the instruction, and with it blanked.

    python benchmarks/instructed_reach.py [--seeds 3] [--layouts one,split5,split5-fsdp] [--configs grpo,ppo]
        [--instructions read,blanked] [--steps N]

Runs the example's grpo.yaml (env.action_chunk 4, env.group_size 8, 128 envs; `--configs grpo,ppo` also its
ppo.yaml, the same env and chunks without groups, 32 envs) with its folder importable, per seed and layout; every
layout runs the config's env.num_envs in all (env.total_envs), so an iteration is the same batch in each.
`--instructions read,blanked` adds the control, the same runs with env.kwargs.blank_instruction=true: every
instruction reads "reach the target", so a policy can only pick one of the three targets (1/3 success expected).
Success is the per-iteration success_rate (the iteration's whole episodes, one per env) averaged over WINDOW
iterations: "steps to 0.9" is the first iteration where that average reaches 0.9, "final" is its value at the end
of the budget. Not episode_return_mean: with whole-episode rollouts the last 20 episodes to end in an iteration are
its longest ones, the failures.
"""

from __future__ import annotations

import argparse
import os

import yaml
from common import ROOT, machine, run_spmd, table

FOLDER = ROOT / "examples" / "instructed_reach"
TARGET = 0.9
WINDOW = 5  # iterations per success average (640 episodes, 80 groups of grpo.yaml)
SPLIT5 = ["layout.mode=split", "layout.trainer=2", "layout.inference=1", "layout.env=2"]
# layout: (torchrun processes (0 = plain python), overrides)
LAYOUTS = {
    "one": (0, []),
    "split5": (5, SPLIT5),
    "split5-fsdp": (5, [*SPLIT5, "train.parallel=fsdp"]),
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
    parser.add_argument(
        "--instructions", default="read", help="read, blanked (the control: every instruction the same) or both"
    )
    parser.add_argument("--steps", type=int, help="train.total_steps (default: the config's)")
    args = parser.parse_args()
    print(f"machine: {machine()}; load average at start {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    rows = []
    for layout, config in [
        (layout, config) for layout in args.layouts.split(",") for config in args.configs.split(",")
    ]:
        nproc, overrides = LAYOUTS[layout]
        config_file = FOLDER / f"{config}.yaml"
        total_envs = yaml.safe_load(config_file.read_text())["env"]["num_envs"]  # in all, whatever the layout
        for instruction in args.instructions.split(","):
            blank = ["env.kwargs.blank_instruction=true"] if instruction == "blanked" else []
            for seed in range(1, args.seeds + 1):
                budget = [f"train.total_steps={args.steps}"] if args.steps else []
                records = run_spmd(
                    [*overrides, f"env.total_envs={total_envs}", *blank, *budget, f"train.seed={seed}"],
                    nproc=nproc,
                    config=str(config_file),
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
