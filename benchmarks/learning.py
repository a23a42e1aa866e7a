"""Env steps and wall time until CartPole-v1 is solved (mean of the last 20 episode returns >= 475).

    python benchmarks/learning.py [--seeds 5] [--layouts one,colocated2,split8] [--no-sb3]

spmd_rl runs its default config as a user would; Stable-Baselines3 PPO runs the same hyperparameters, read from
that default config, in this process (needs the bench extra). Wall time is training time: from the first
iteration (spmd_rl: its metrics' wall_s; SB3: learn()) to the solving iteration, imports and start-up excluded.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import machine, run_spmd, table, versions_line

from spmd_rl.config.loading import load_config

SOLVED = 475.0
BUDGET = 100_000
WINDOW = 20

LAYOUTS = {
    # name: (torchrun processes (0 = plain python), config, overrides) — all with 8 envs in all, 256 steps/iteration
    "one": (0, None, []),
    "colocated2": (2, None, ["env.num_envs=4"]),
    "split8": (8, "configs/ppo_cartpole_split.yaml", []),
    "async6": (6, "configs/ppo_cartpole_async.yaml", []),  # async engine, V-trace, max_policy_lag 2
    # Large-policy paths (README "Large policies") on the same default config:
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--layouts", default="one,colocated2,split8")
    parser.add_argument("--no-sb3", action="store_true")
    args = parser.parse_args()
    print(f"machine: {machine()}")
    print(versions_line())
    runs: dict[str, list[dict]] = {}
    for seed in range(1, args.seeds + 1):
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
