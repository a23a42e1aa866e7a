"""Pipeline stages (env.pipeline_stages): how much of the bound max(E, I) a rollout reaches when env time E and
inference time I overlap, against S = 1, where they add up.

    python benchmarks/pipeline.py [--stages 1,2,4] [--steps 32] [--iterations 5]

The split layout with two env ranks, one inference rank and one trainer (torchrun, 4 processes). Each env step
sleeps (benchmarks/slow_env.py) and the policy's forward pass sleeps per env of its batch
(benchmarks/slow_policy.py), so the times are set, not measured, and hold on a busy machine: per step an env rank
spends E = envs x the step's sleep, the inference rank I = all env ranks' envs x the forward pass's sleep. Three
splits: E = I, E = 3 I (env-bound) and I = 3 E (inference-bound).

A step's time is the rollout's time (time_rollout_s: from one segment sent to the next) less the trainer's learning
and weight sync, which the env ranks wait for before their next rollout, over the steps of a rollout; the first
iteration (start-up) is left out. The ratio is that time over the bound max(E, I); the speed-up is S = 1's time over
S's. E and I are given as set (the sleeps) and as measured (time_env_s, time_inference_s: a sleep overshoots,
most on a busy machine), and the ratio against both bounds. The idle columns are each side's waiting per step
(time_env_idle_s, time_inference_idle_s).
"""

from __future__ import annotations

import argparse
import statistics

from common import machine, run_spmd, table

ENV_RANKS, ENVS = 2, 8  # per env rank
SPLITS = {  # name: (seconds an env step sleeps, seconds the forward pass sleeps per env)
    "E = I": (0.002, 0.001),  # E = 8 x 2 ms = 16 ms, I = 16 x 1 ms = 16 ms
    "E = 3I": (0.003, 0.0005),  # E = 24 ms, I = 8 ms
    "I = 3E": (0.001, 0.0015),  # E = 8 ms, I = 24 ms
}


def step_times(stages: int, env_sleep: float, act_sleep: float, steps: int, iterations: int) -> dict[str, float]:
    records = run_spmd(
        [
            "layout.mode=split",
            "layout.trainer=1",
            "layout.inference=1",
            f"layout.env={ENV_RANKS}",
            "env.id=benchmarks.slow_env:SlowCartPole-v1",
            f"env.kwargs={{step_sleep_s: {env_sleep}}}",
            "env.vectorization=sync",
            f"env.num_envs={ENVS}",
            f"env.pipeline_stages={stages}",
            "policy.class=benchmarks.slow_policy:SlowActorCritic",
            f"policy.act_sleep_s_per_env={act_sleep}",
            f"algo.num_steps={steps}",
            "algo.update_epochs=1",
            "algo.num_minibatches=1",
            f"train.total_steps={iterations * steps * ENVS * ENV_RANKS}",
        ],
        nproc=2 + ENV_RANKS,
        timeout=900,
    )[1:]

    def per_step(value) -> float:
        return statistics.median(value(r) for r in records) / steps

    return {
        "step": per_step(lambda r: r["time_rollout_s"] - r["time_learn_s"] - r["time_weight_sync_s"]),
        "env": per_step(lambda r: r["time_env_s"]),
        "inference": per_step(lambda r: r["time_inference_s"]),
        "env_idle": per_step(lambda r: r["time_env_idle_s"]),
        "inference_idle": per_step(lambda r: r["time_inference_idle_s"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", default="1,2,4")
    parser.add_argument("--steps", type=int, default=32, help="algo.num_steps: steps per rollout")
    parser.add_argument("--iterations", type=int, default=5)
    args = parser.parse_args()
    stage_counts = [int(s) for s in args.stages.split(",")]
    rows = []
    for name, (env_sleep, act_sleep) in SPLITS.items():
        env_s, inference_s = ENVS * env_sleep, ENV_RANKS * ENVS * act_sleep
        base = None
        for stages in stage_counts:
            t = step_times(stages, env_sleep, act_sleep, args.steps, args.iterations)
            base = t["step"] if stages == 1 else base
            rows.append(
                [
                    name,
                    f"{env_s * 1e3:.0f} / {inference_s * 1e3:.0f}",
                    f"{t['env'] * 1e3:.1f} / {t['inference'] * 1e3:.1f}",
                    stages,
                    f"{t['step'] * 1e3:.1f}",
                    f"{t['step'] / max(env_s, inference_s):.2f}x",
                    f"{t['step'] / max(t['env'], t['inference']):.2f}x",
                    f"{base / t['step']:.2f}x" if base else "-",
                    f"{t['env_idle'] * 1e3:.1f} / {t['inference_idle'] * 1e3:.1f}",
                ]
            )
            print(rows[-1], flush=True)
    print(machine())
    print(
        table(
            [
                "split",
                "E / I set (ms)",
                "E / I measured (ms)",
                "S",
                "step (ms)",
                "vs max(E, I) set",
                "vs max(E, I) measured",
                "speed-up vs S=1",
                "idle env / inference (ms)",
            ],
            rows,
        )
    )


if __name__ == "__main__":
    main()
