"""The async engine against the sync engine, in one run: env steps per second on envs of uneven speed, and the
split layout's scaling on the 5 ms env.

    python benchmarks/async.py [--parts uneven,slow_rank,scaling] [--env-ranks 4,8] [--repeats 2] [--lag 2]

Every run: PPO on a CartPole stand-in (benchmarks/uneven_env.py, benchmarks/slow_env.py), one env per env rank,
64 steps per rollout, 4 epochs, 1 trainer and 1 inference rank. Async runs use algo.vtrace=true and
engine.max_policy_lag=LAG; sync runs the same PPO without V-trace (V-trace changes the math, not the schedule).
SPS from the end of the first iteration on (start-up excluded), best of --repeats, sync and async alternating so a
change in the machine's load hits both alike.

- uneven:    --env-ranks env ranks (one row each), every step sleeping a random 1-10 ms (goal: async >= 1.5x
             sync). "ideal" is the ratio with no overhead at all: sync waits for the slowest env rank every step
             (the mean of the largest of k uniform draws), async steps at the mean draw.
- slow_rank: --env-ranks env ranks at 5 ms per step, the last of them at 20 ms (4x). Ideal 1.00x: an iteration
             takes one segment from every env rank, so both engines go at the slow rank's pace.
- scaling:   1, 2, 4 env ranks at 5 ms per step; linear = k x the better engine's 1-rank SPS
             (goal: async >= 0.9x linear at 4 env ranks)
"""

from __future__ import annotations

import argparse

from common import SPLIT_ONE_ENV_PER_RANK, machine, run_spmd, table
from uneven_env import HIGH_S, LOW_S

ITERATIONS = 16
VERSUS_HEADERS = [
    "env ranks' step time",
    "env ranks",
    "sync SPS",
    "async SPS",
    "async / sync",
    "ideal",
    "lag mean",
    "lag max",
]


def engine(name: str, lag: int) -> list[str]:
    if name == "sync":
        return ["engine.class=sync"]
    return ["engine.class=async", f"engine.max_policy_lag={lag}", "algo.vtrace=true"]


def steady_sps(overrides: list[str], env_ranks: int) -> tuple[float, dict]:
    records = run_spmd(
        [
            *SPLIT_ONE_ENV_PER_RANK,
            *overrides,
            f"layout.env={env_ranks}",
            f"train.total_steps={64 * env_ranks * ITERATIONS}",
        ],
        nproc=2 + env_ranks,
    )
    first, last = records[0], records[-1]
    sps = (last["env_steps"] - first["env_steps"]) / (last["wall_s"] - first["wall_s"])
    lags = [r.get("policy_lag_mean", 0.0) for r in records[1:]]
    return sps, {"lag_mean": sum(lags) / len(lags), "lag_max": max(r.get("policy_lag_max", 0.0) for r in records)}


def versus(env: list[str], env_ranks: int, repeats: int, lag: int, ideal: float) -> list:
    results = {"sync": [], "async": []}
    for _ in range(repeats):
        for name in results:
            results[name].append(steady_sps(env + engine(name, lag), env_ranks))
    sync = max(sps for sps, _ in results["sync"])
    best_async, info = max(results["async"], key=lambda r: r[0])
    return [
        f"{sync:.0f}",
        f"{best_async:.0f}",
        f"{best_async / sync:.2f}x",
        f"{ideal:.2f}x",
        f"{info['lag_mean']:.2f}",
        f"{info['lag_max']:.0f}",
    ]


def uneven_ideal(env_ranks: int) -> float:
    """Sync's mean step (the largest of env_ranks uniform draws) over async's (the mean draw), with no overhead."""
    slowest = LOW_S + (HIGH_S - LOW_S) * env_ranks / (env_ranks + 1)
    return slowest / ((LOW_S + HIGH_S) / 2)


def uneven(env_ranks: list[int], repeats: int, lag: int) -> None:
    env = ["env.id=benchmarks.uneven_env:UnevenCartPole-v1"]
    rows = [
        [f"random {LOW_S * 1e3:g}-{HIGH_S * 1e3:g} ms per step", k, *versus(env, k, repeats, lag, uneven_ideal(k))]
        for k in env_ranks
    ]
    print(table(VERSUS_HEADERS, rows))


def slow_rank(env_ranks: list[int], repeats: int, lag: int) -> None:
    rows = []
    for k in env_ranks:
        # World ranks: trainer 0, inference 1, env ranks 2 .. k+1; the last one is slow.
        env = ["env.id=benchmarks.uneven_env:SlowRankCartPole-v1", f"env.kwargs={{slow_rank: {k + 1}}}"]
        rows.append(["5 ms, one rank 20 ms", k, *versus(env, k, repeats, lag, 1.0)])
    print(table(VERSUS_HEADERS, rows))


def scaling(env_ranks: list[int], repeats: int, lag: int) -> None:
    env = ["env.id=benchmarks.slow_env:SlowCartPole-v1"]
    rows, base = [], None
    for k in (1, 2, 4):
        best = {}
        for _ in range(repeats):
            for name in ("sync", "async"):
                sps, _ = steady_sps(env + engine(name, lag), k)
                best[name] = max(best.get(name, 0.0), sps)
        # Linear: k x the better engine's 1-rank SPS (a slower 1-rank run must not flatter its own ratio).
        base = base or max(best.values())
        rows.append(
            [
                k,
                2 + k,
                f"{best['sync']:.0f}",
                f"{best['sync'] / (base * k):.2f}",
                f"{best['async']:.0f}",
                f"{best['async'] / (base * k):.2f}",
            ]
        )
    print(table(["env ranks", "world size", "sync SPS", "sync vs linear", "async SPS", "async vs linear"], rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="uneven,slow_rank,scaling")
    parser.add_argument("--env-ranks", default="4,8", help="env ranks of the uneven and slow_rank rows")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--lag", type=int, default=2)
    args = parser.parse_args()
    env_ranks = [int(k) for k in args.env_ranks.split(",")]
    print(f"machine: {machine()}")
    print(f"async: engine.max_policy_lag={args.lag}, algo.vtrace=true; best of {args.repeats}, alternating")
    for part in args.parts.split(","):
        {"uneven": uneven, "slow_rank": slow_rank, "scaling": scaling}[part](env_ranks, args.repeats, args.lag)


if __name__ == "__main__":
    main()
