"""SAC on Pendulum-v1: env steps until the mean of the last 20 episode returns reaches -200, and the final mean.

    python benchmarks/learning_sac.py [--seeds 3] [--layouts one,split4,async4]

Runs configs/sac_pendulum.yaml (20k env steps) as a user would. split4: 1 trainer, 1 inference and 2 env ranks
(one Pendulum each: the same total env steps, twice the envs). async4: the same layout and SAC under the async
engine (configs/sac_pendulum_async.yaml: max_policy_lag 4, 25k env steps); its policy lag is reported from the
versions the trainer received.
"""

from __future__ import annotations

import argparse

from common import machine, run_spmd, table, versions_line

TARGET = -200.0
SPLIT4 = ["layout.mode=split", "layout.trainer=1", "layout.inference=1", "layout.env=2"]
LAYOUTS = {
    # name: (torchrun processes (0 = plain python), config, overrides)
    "one": (0, "configs/sac_pendulum.yaml", []),
    "split4": (4, "configs/sac_pendulum.yaml", SPLIT4),
    "async4": (4, "configs/sac_pendulum_async.yaml", []),
}


def lag(records: list[dict]) -> str:
    """Mean over the run of each iteration's mean lag, and the largest lag of any step ("-": the sync engine)."""
    if "policy_lag_mean" not in records[-1]:
        return "-"
    means = [r["policy_lag_mean"] for r in records]
    return f"{sum(means) / len(means):.2f} / {max(r['policy_lag_max'] for r in records):.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--layouts", default="one,split4")
    args = parser.parse_args()
    print(f"machine: {machine()}")
    print(versions_line())
    rows = []
    for layout in args.layouts.split(","):
        nproc, config, overrides = LAYOUTS[layout]
        reached, finals, walls, lags = [], [], [], []
        for seed in range(1, args.seeds + 1):
            records = run_spmd(overrides + [f"train.seed={seed}"], nproc=nproc, config=config)
            hit = next(
                (
                    r
                    for r in records
                    if r["episode_return_mean"] is not None
                    and r["episode_return_mean"] >= TARGET
                    and r["episodes"] >= 20
                ),
                None,
            )
            reached.append(hit["env_steps"] if hit else None)
            finals.append(records[-1]["episode_return_mean"])
            walls.append(records[-1]["wall_s"])
            lags.append(lag(records))
            print(
                f"{layout} seed {seed}: reached {reached[-1]}, final {finals[-1]:.1f} after "
                f"{records[-1]['env_steps']} env steps, lag mean/max {lags[-1]}, wall {walls[-1]:.0f} s",
                flush=True,
            )
        ok = sum(1 for f in finals if f >= TARGET)
        rows.append(
            [
                layout,
                f"{ok}/{len(finals)}",
                " ".join(str(r) if r else "-" for r in reached),
                " ".join(f"{f:.0f}" for f in finals),
                ", ".join(lags),
                f"{sum(walls) / len(walls):.0f}",
            ]
        )
    print(
        table(
            [
                "layout",
                "final >= -200",
                "env steps to reach -200 (per seed)",
                "final mean of last 20",
                "policy lag mean / max (per seed)",
                "mean wall s",
            ],
            rows,
        )
    )


if __name__ == "__main__":
    main()
