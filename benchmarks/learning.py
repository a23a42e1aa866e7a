"""Env steps and wall time until CartPole-v1 is solved (mean of the last 20 episode returns >= 475).

    python benchmarks/learning.py [--seeds 5 | --seed-list 5,6] [--layouts one,colocated2,split8] [--no-sb3]

spmd_rl runs its default config as a user would; Stable-Baselines3 PPO runs the same hyperparameters, read from
that default config, in this process (needs the bench extra). Wall time is training time: from the first
iteration (spmd_rl: its metrics' wall_s; SB3: learn()) to the solving iteration, imports and start-up excluded.

A config over seeds, beside the published numbers (the seed runner):

    nice -n 19 python benchmarks/learning.py --config configs/mujoco/ppo_halfcheetah.yaml --seeds 3 \
        --out /work/bench28 [--parallel 2] [--report-only] [section.key=value ...]

runs `python -m spmd_rl.main` once per seed (train.seed = 1..N), --parallel at a time, each in its own run directory
OUT/<config name>[+<overrides>]/seed<N> (its console in seed<N>.log beside it), then prints one table: the final
deterministic evaluation (the config's eval.every must evaluate the last iteration) and the mean of the last 20
training episodes, mean +- std over the seeds, beside the published numbers; the same table and the versions go to
OUT/<...>/results.md. A stopped or killed benchmark resumes by rerunning the same command: finished seeds are
skipped, unfinished ones rerun with their run directory, which resumes them from their last checkpoint as any run
does. --report-only prints the table of what has finished so far.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from common import ROOT, machine, run_spmd, table, versions, versions_line

from spmd_rl.config.loading import load_config
from spmd_rl.persist.run_files import FINISHED, METRICS_FILE

SOLVED = 475.0
BUDGET = 100_000
WINDOW = 20

LAYOUTS = {
    # name: (torchrun processes (0 = plain python), config, overrides) — all with 8 envs in all, 256 steps/iteration
    "one": (0, None, []),
    "colocated2": (2, None, ["env.num_envs=4"]),
    "split8": (8, "configs/ppo_cartpole_split.yaml", []),
    "async6": (6, "configs/ppo_cartpole_async.yaml", []),  # async engine, V-trace, max_policy_lag 2
    # Large-policy paths (docs/large-policies.md) on the same default config:
    "one-bf16": (0, None, ["train.precision=bf16"]),
    "colocated2-fsdp": (2, None, ["env.num_envs=4", "train.parallel=fsdp"]),
}


def spmd_solve(layout: str, seed: int) -> dict:
    nproc, config, overrides = LAYOUTS[layout]
    records = run_spmd(overrides + [f"train.seed={seed}", f"train.total_steps={BUDGET}"], nproc=nproc, config=config)
    solved = next((r for r in records if (r["episode_return_mean"] or 0) >= SOLVED), None)
    return {
        "steps": solved["env_steps"] if solved else None,
        "wall_s": solved["wall_s"] if solved else None,
        "final": records[-1]["episode_return_mean"],
    }


def sb3_solve(seed: int) -> dict:
    from stable_baselines3 import PPO
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.env_util import make_vec_env

    def linear(start):
        return lambda progress_remaining: progress_remaining * start

    class StopWhenSolved(BaseCallback):
        solved_at = None
        solved_wall = None

        def _on_step(self) -> bool:
            returns = [e["r"] for e in list(self.model.ep_info_buffer)[-WINDOW:]]
            if self.solved_at is None and len(returns) == WINDOW and sum(returns) / WINDOW >= SOLVED:
                self.solved_at, self.solved_wall = self.num_timesteps, time.perf_counter() - start
            return self.solved_at is None

    # The default config's values, so that both sides always run the same settings (SB3's MlpPolicy is the same
    # 64x64 tanh actor and critic, with Adam eps 1e-5 as ours).
    cfg = load_config(None)
    algo = cfg.algo
    assert cfg.env.id == "CartPole-v1" and not algo.clip_value_loss and algo.target_kl is None
    assert cfg.policy.hidden_sizes == [64, 64] and cfg.policy.activation == "tanh" and not cfg.policy.normalize_obs
    torch.set_num_threads(1)
    env = make_vec_env("CartPole-v1", n_envs=cfg.env.num_envs, seed=seed)
    model = PPO(
        "MlpPolicy",
        env,
        n_steps=algo.num_steps,
        batch_size=cfg.env.num_envs * algo.num_steps // algo.num_minibatches,
        gae_lambda=algo.gae_lambda,
        gamma=algo.gamma,
        n_epochs=algo.update_epochs,
        ent_coef=algo.ent_coef,
        vf_coef=algo.vf_coef,
        max_grad_norm=algo.max_grad_norm,
        normalize_advantage=algo.normalize_advantages,
        learning_rate=linear(algo.learning_rate) if algo.anneal_lr else algo.learning_rate,
        clip_range=linear(algo.clip_coef) if algo.anneal_clip else algo.clip_coef,
        seed=seed,
        device="cpu",
    )
    callback = StopWhenSolved()
    start = time.perf_counter()
    model.learn(total_timesteps=BUDGET, callback=callback)
    returns = [e["r"] for e in list(model.ep_info_buffer)[-WINDOW:]]
    return {"steps": callback.solved_at, "wall_s": callback.solved_wall, "final": sum(returns) / len(returns)}


def fmt(value, digits=1):
    return "-" if value is None else (f"{value:.{digits}f}" if isinstance(value, float) else str(value))


# ---------------------------------------------------------------------------------------------------------------
# A config over seeds, beside the published numbers

# (source, its mean, its std). RL Zoo: benchmark.md of rl-baselines3-zoo (commit 22e3ff2): one trained agent per
# task (v3), its deterministic evaluation over ~150k steps; that std is over its episodes, not over seeds. CleanRL:
# its ppo_continuous_action (untuned) on v4, as issue 28 quotes it.
PUBLISHED = {
    "ppo_halfcheetah": [
        ("RL Zoo PPO, HalfCheetah-v3, 1M", 5819.1, 663.5),
        ("CleanRL PPO, HalfCheetah-v4", 1442.6, 46.0),
    ],
    "ppo_hopper": [("RL Zoo PPO, Hopper-v3, 1M", 2410.4, 10.0)],
    "ppo_walker2d": [("RL Zoo PPO, Walker2d-v3, 1M", 3478.8, 821.7)],
    "sac_halfcheetah": [("RL Zoo SAC, HalfCheetah-v3, 1M", 9535.5, 100.5)],
    "sac_hopper": [("RL Zoo SAC, Hopper-v3, 1M", 2325.5, 1129.7)],
    "sac_walker2d": [("RL Zoo SAC, Walker2d-v3, 1M", 3863.2, 254.3)],
    "dqn_cartpole": [("RL Zoo DQN, CartPole-v1, 50k", 500.0, 0.0)],
}


def bench_dir(out: Path, config: Path, overrides: list[str]) -> Path:
    """OUT/<config stem>[+<overrides>]: other overrides are other runs (a run directory resumes only its config)."""
    tag = "+".join(re.sub(r"[^A-Za-z0-9_.=-]", "_", o) for o in overrides)
    return out / (config.stem + (f"+{tag}" if tag else ""))


def run_seed(config: Path, seed: int, where: Path, overrides: list[str], timeout_s: float) -> int:
    """One seed's run, resumed if its directory holds an unfinished one; its exit code (0: finished)."""
    run_dir = where / f"seed{seed}"
    if (run_dir / FINISHED).exists():
        print(f"seed {seed}: finished before, skipped ({run_dir})", flush=True)
        return 0
    resuming = (run_dir / METRICS_FILE).exists()
    cmd = [sys.executable, "-m", "spmd_rl.main", "--config", str(config.resolve()), *overrides]
    cmd += [f"train.seed={seed}", f"run.dir={run_dir}", "log.progress=false"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    print(f"seed {seed}: {'resuming' if resuming else 'starting'} in {run_dir}", flush=True)
    with open(where / f"seed{seed}.log", "a") as log:
        log.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} {versions_line()}\n$ {' '.join(cmd)}\n")
        log.flush()
        try:
            run = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            print(f"seed {seed}: still running after --timeout-h, killed (rerun to resume it)", flush=True)
            return 124
    code = run.returncode
    print(f"seed {seed}: exit {code}" + ("" if code == 0 else f" (see {where}/seed{seed}.log; rerun to resume)"))
    if code == 0:
        (run_dir / "versions.json").write_text(json.dumps(versions()) + "\n")
    return code


def seed_result(run_dir: Path) -> dict | None:
    """A finished seed's final evaluation (None unless the last iteration was evaluated) and the mean of its last
    20 training episodes; None while the seed is unfinished."""
    if not (run_dir / FINISHED).exists():
        return None
    records = [json.loads(line) for line in (run_dir / METRICS_FILE).read_text().splitlines()]
    evaluated = [r for r in records if r.get("eval_return_mean") is not None]
    last = records[-1]
    final_eval = evaluated[-1] if evaluated and evaluated[-1]["iteration"] == last["iteration"] else None
    return {
        "eval": final_eval["eval_return_mean"] if final_eval else None,
        "train": last["episode_return_mean"],
        "env_steps": last["env_steps"],
        "wall_s": last["wall_s"],
    }


def mean_std(values: list[float]) -> str:
    if not values:
        return "-"
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.0f} +- {std:.0f}"


def seeds_table(config: Path, where: Path, seeds: list[int]) -> str:
    """Ours (mean +- std over the finished seeds) above the published numbers for the config, in one table."""
    done = {s: r for s in seeds if (r := seed_result(where / f"seed{s}")) is not None}
    evals = [r["eval"] for r in done.values() if r["eval"] is not None]
    trains = [r["train"] for r in done.values() if r["train"] is not None]
    ours = statistics.mean(evals) if evals else None
    rows = [
        [
            f"spmd_rl {where.name}",
            f"{len(done)}/{len(seeds)}",
            mean_std(evals),
            " ".join("-" if r["eval"] is None else f"{r['eval']:.0f}" for r in done.values()) or "-",
            mean_std(trains),
            f"{statistics.mean(r['env_steps'] for r in done.values()):.0f}" if done else "-",
            f"{statistics.mean(r['wall_s'] for r in done.values()) / 60:.0f}" if done else "-",
            "",
        ]
    ]
    for source, mean, std in PUBLISHED.get(config.stem, []):
        versus = f"{ours - mean:+.0f} ({ours / mean:.2f}x)" if ours is not None and mean else "-"
        rows.append([source, "1 agent", f"{mean:.0f} +- {std:.0f}", "", "", "", "", versus])
    headers = [
        "run",
        "seeds done",
        "final eval (deterministic), mean +- std over seeds",
        "per seed",
        "last 20 training episodes",
        "env steps",
        "wall min/run",
        "spmd_rl vs this",
    ]
    return table(headers, rows)


def run_seeds(args, overrides: list[str]) -> int:
    config = Path(args.config)
    if not config.is_file():
        print(f"learning.py: --config {config}: no such file", file=sys.stderr)
        return 2
    where = bench_dir(Path(args.out), config, overrides)
    where.mkdir(parents=True, exist_ok=True)
    seeds = seed_list(args)
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    header = f"machine: {machine()}; load average at start {load}\n{versions_line()}"
    print(header, flush=True)
    codes = {}
    if not args.report_only:
        with ThreadPoolExecutor(max_workers=args.parallel) as pool:
            futures = {s: pool.submit(run_seed, config, s, where, overrides, args.timeout_h * 3600) for s in seeds}
            codes = {s: future.result() for s, future in futures.items()}
    result = seeds_table(config, where, seeds)
    print(result)
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    chosen = f"--seed-list {args.seed_list}" if args.seed_list else f"--seeds {args.seeds}"
    command = " ".join(["--config", str(config), chosen, *overrides])
    (where / "results.md").write_text(f"learning.py {command}\n\n{header}; at the end {load}\n\n{result}\n")
    failed = [s for s, code in codes.items() if code != 0]
    if failed:
        print(f"seeds {failed} did not finish: rerun the same command to resume them", file=sys.stderr)
        return 1
    return 0


def seed_list(args) -> list[int]:
    """--seed-list (e.g. one seed left over from an earlier run) or 1..--seeds."""
    if not args.seed_list:
        return list(range(1, args.seeds + 1))
    try:
        return [int(s) for s in args.seed_list.split(",")]
    except ValueError:
        print(f"learning.py: --seed-list {args.seed_list}: comma-separated integers expected", file=sys.stderr)
        sys.exit(2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--seed-list", default="", help="these seeds (comma-separated) instead of 1..--seeds")
    parser.add_argument("--layouts", default="one,colocated2,split8")
    parser.add_argument("--no-sb3", action="store_true")
    parser.add_argument("--config", help="the seed runner: this config over seeds 1..--seeds (see above)")
    parser.add_argument("--out", default=str(ROOT / "runs" / "bench"), help="the seed runner's folder of runs")
    parser.add_argument(
        "--parallel", type=int, default=2, help="the seed runner's runs at a time", choices=range(1, 65)
    )
    parser.add_argument("--timeout-h", type=float, default=24.0, help="the seed runner's bound on one run, hours")
    parser.add_argument("--report-only", action="store_true", help="the seed runner: print the table, run nothing")
    args, overrides = parser.parse_known_args()
    seed_list(args)  # a bad --seed-list is refused before anything runs
    if args.config:
        sys.exit(run_seeds(args, overrides))
    if overrides:
        parser.error(f"unrecognized arguments: {' '.join(overrides)} (config overrides need --config)")
    print(f"machine: {machine()}")
    print(versions_line())
    runs: dict[str, list[dict]] = {}
    for seed in seed_list(args):
        if not args.no_sb3:
            runs.setdefault("sb3 (same settings)", []).append(sb3_solve(seed))
        for layout in args.layouts.split(","):
            runs.setdefault(f"spmd_rl {layout}", []).append(spmd_solve(layout, seed))
        print(f"seed {seed} done", flush=True)

    baseline = runs.get("sb3 (same settings)")
    baseline_wall = statistics.median([r["wall_s"] for r in baseline if r["wall_s"]]) if baseline else None
    rows = []
    for name, results in runs.items():
        steps = [r["steps"] for r in results]
        walls = [r["wall_s"] for r in results if r["wall_s"] is not None]
        solved = [s for s in steps if s is not None]
        median_wall = statistics.median(walls) if walls else None
        rows.append(
            [
                name,
                f"{len(solved)}/{len(results)}",
                " ".join(fmt(s) for s in steps),
                fmt(statistics.median(solved) if solved else None, 0),
                fmt(median_wall),
                fmt(median_wall / baseline_wall, 2) if median_wall and baseline_wall else "-",
                " ".join(fmt(r["final"], 0) for r in results),
            ]
        )
    print(
        table(
            [
                "run",
                "solved",
                "env steps to solve (per seed)",
                "median steps",
                "median wall s",
                "wall vs sb3",
                "final return (per seed)",
            ],
            rows,
        )
    )


if __name__ == "__main__":
    main()
