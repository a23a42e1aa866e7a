"""Per-group learning of an env-group run: configs/ppo_cartpole_groups.yaml (CartPole with three pole lengths as
groups, a fourth length held out for evaluation).

    python benchmarks/env_groups.py [--seeds 3] [--layouts one,split4,single] [--steps N]

For each group: the env steps until its mean return over its last 20 episodes reaches 475
(episode_return_mean/<group>), its return at the end, and the last evaluation's return per group, the held-out
length included (eval_return_mean/<group>, deterministic actions, eval.episodes per group). `single` is the
baseline: the same config and evaluation, trained on the standard length alone (no groups, the same 12 envs).
"""

from __future__ import annotations

import argparse
import os
import statistics

from common import ROOT, machine, run_spmd, table

from spmd_rl.config.loading import evaluation_env, load_config

CONFIG = "configs/ppo_cartpole_groups.yaml"
SOLVED = 475.0
LAYOUTS = {  # name: (torchrun processes (0 = plain python), overrides); the same 12 envs in every layout
    "one": (0, []),
    "colocated2": (2, []),
    "split4": (4, ["layout.mode=split", "layout.trainer=1", "layout.inference=1", "layout.env=2"]),
    "single": (0, ["env.groups=[]", "env.kwargs={length: 0.5}", "env.total_envs=12"]),
}


def fmt(value, digits=0):
    return "-" if value is None else f"{value:.{digits}f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--layouts", default="one")
    parser.add_argument("--steps", type=int, help="train.total_steps (default: the config's)")
    args = parser.parse_args()
    cfg = load_config(ROOT / CONFIG)
    train_groups = cfg.env.group_names()
    eval_groups = evaluation_env(cfg).group_names()
    print(f"machine: {machine()}; load average at start {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    rows = []
    for layout in args.layouts.split(","):
        nproc, overrides = LAYOUTS[layout]
        for seed in range(1, args.seeds + 1):
            budget = [f"train.total_steps={args.steps}"] if args.steps else []
            records = run_spmd([*overrides, *budget, f"train.seed={seed}"], nproc=nproc, config=CONFIG)
            solved = []
            for key in ["episode_return_mean", *(f"episode_return_mean/{name}" for name in train_groups)]:
                first = next((r for r in records if (r.get(key) or 0) >= SOLVED), None)
                solved.append(fmt(first["env_steps"] if first else None))
            last_eval = [r for r in records if "eval_return_mean" in r][-1]
            rows.append(
                [
                    layout,
                    seed,
                    *solved,
                    " / ".join(fmt(records[-1].get(f"episode_return_mean/{name}")) for name in train_groups),
                    *(fmt(last_eval[f"eval_return_mean/{name}"]) for name in eval_groups),
                    fmt(records[-1]["wall_s"]),
                ]
            )
            print(f"{layout} seed {seed} done; load average {os.getloadavg()[0]:.2f}", flush=True)
    headers = [
        "layout",
        "seed",
        "steps to 475: all",
        *(f"steps to 475: {name}" for name in train_groups),
        f"final return ({' / '.join(train_groups)})",
        *(f"eval {name}" for name in eval_groups),
        "wall s",
    ]
    print(table(headers, rows))
    solved_steps = [float(row[3 + i]) for row in rows for i in range(len(train_groups)) if row[3 + i] != "-"]
    if solved_steps:
        print(f"median env steps to 475 over groups, seeds and layouts: {statistics.median(solved_steps):.0f}")


if __name__ == "__main__":
    main()
