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

    python benchmarks/pipeline.py --layout colocated [--stages 1,2,4]

One process (the colocated layout, world size 1), 8 envs in gymnasium's AsyncVectorEnv (env.vectorization=async:
one worker process per env), so each stage's envs step on their thread while the policy acts for the next stage.
The envs' workers step in parallel, so a step of any stage takes E = the step's sleep; I = 8 x the forward pass's
sleep, a stage's pass I / S. Stage s's step begins after its pass and must end before its next one, after the
other stages' passes: a step costs max(I, E + I / S) (the model bound, column "vs model"), E + I with one stage; at
E = I that is 1.33x for S = 2 and 1.6x for S = 4, not the split layout's 2x. A step is a rollout's time less the
previous iteration's learning (a colocated rollout's time runs from the previous segment, so it holds that
iteration's learning) over its steps; measured E is a stage's step (time_env_s sums the stages' steps, which run at
once). The idle columns are the split layout's only: one process waits for no peer.

    python benchmarks/pipeline.py --env metaworld [--layout colocated] [--stages 1,2] [--chunks 4,1]

Real envs and a real policy: MetaWorld's reach-v3 at 64x64 (configs/metaworld/'s env section: the corner2 camera,
rendered with EGL or OSMesa) and the vla policy's tiny preset (4.4M parameters), 8 envs per env rank, action chunks
of each of --chunks (configs/metaworld/ use 4: each decision is 4 env steps, so E grows with K and I does not). E and
I are measured only; the step, speed-up and idle columns are as above. Each run takes minutes on 2 cores: use a few
--iterations and --steps.
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
COLOCATED_SPLITS = {  # one process, 8 envs stepping in parallel worker processes: E = the sleep, I = 8 x its sleep
    "E = I": (0.016, 0.002),  # E = 16 ms, I = 16 ms
    "E = 3I": (0.024, 0.001),  # E = 24 ms, I = 8 ms
    "I = 3E": (0.008, 0.003),  # E = 8 ms, I = 24 ms
}


def set_times(layout: str, env_sleep: float, act_sleep: float) -> tuple[float, float]:
    """(E, I) per step as the sleeps set them (see the module docstring)."""
    if layout == "colocated":
        return env_sleep, ENVS * act_sleep
    return ENVS * env_sleep, ENV_RANKS * ENVS * act_sleep


def slow_run(stages: int, env_sleep: float, act_sleep: float, steps: int) -> list[str]:
    """The overrides of a run with the set times: the sleeping env and policy, S stages, short PPO updates."""
    return [
        "env.id=benchmarks.slow_env:SlowCartPole-v1",
        f"env.kwargs={{step_sleep_s: {env_sleep}}}",
        f"env.num_envs={ENVS}",
        f"env.pipeline_stages={stages}",
        "policy.class=benchmarks.slow_policy:SlowActorCritic",
        f"policy.act_sleep_s_per_env={act_sleep}",
        f"algo.num_steps={steps}",
        "algo.update_epochs=1",
        "algo.num_minibatches=1",
    ]


def step_times(run: list[str], steps: int, env_steps: int) -> dict[str, float]:
    """The split layout (ENV_RANKS env ranks, one inference rank, one trainer) running the overrides `run` for
    env_steps primitive env steps: per step, the medians over iterations (the first left out) of a step's time, E, I
    and each side's idle time (see the module docstring)."""
    records = run_spmd(
        [
            "layout.mode=split",
            "layout.trainer=1",
            "layout.inference=1",
            f"layout.env={ENV_RANKS}",
            "env.vectorization=sync",
            *run,
            f"train.total_steps={env_steps}",
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


def colocated_step_times(run: list[str], steps: int, env_steps: int, stages: int) -> dict[str, float]:
    """One process, the envs in AsyncVectorEnv's workers, running the overrides `run` for env_steps primitive env
    steps: per step, as step_times (see the module docstring)."""
    records = run_spmd(["env.vectorization=async", *run, f"train.total_steps={env_steps}"], timeout=900)
    pairs = list(zip(records, records[1:]))  # (the previous iteration, this one): the first is left out

    def per_step(value) -> float:
        return statistics.median(value(previous, r) for previous, r in pairs) / steps

    return {
        "step": per_step(lambda previous, r: r["time_rollout_s"] - previous["time_learn_s"]),
        # time_env_s sums the stages' steps, which run at once on their threads: one stage's step is E
        "env": per_step(lambda previous, r: r["time_env_s"]) / stages,
        "inference": per_step(lambda previous, r: r["time_inference_s"]),
    }


def metaworld_run(stages: int, chunk: int, steps: int) -> list[str]:
    """The overrides of a run on MetaWorld's reach-v3 at 64x64 (configs/metaworld/'s env section) with the vla
    policy's tiny preset, S stages, action chunks of `chunk`, short PPO updates."""
    return [
        "env.id=metaworld/reach-v3",
        "env.kwargs={camera: corner2, width: 64, height: 64}",
        f"env.num_envs={ENVS}",
        f"env.action_chunk={chunk}",
        "env.max_episode_steps=150",
        "env.max_text_tokens=48",
        f"env.pipeline_stages={stages}",
        "policy.class=vla",
        "policy.preset=tiny",
        f"algo.num_steps={steps}",
        "algo.update_epochs=1",
        "algo.num_minibatches=1",
    ]


def metaworld(args: argparse.Namespace, stage_counts: list[int]) -> None:
    """--env metaworld: S = 1 against S > 1 with real envs and a real policy, E and I measured only."""
    colocated = args.layout == "colocated"
    env_ranks = 1 if colocated else ENV_RANKS
    rows = []
    for chunk in [int(k) for k in args.chunks.split(",")]:
        base = None
        for stages in stage_counts:
            run = metaworld_run(stages, chunk, args.steps)
            env_steps = args.iterations * args.steps * ENVS * env_ranks * chunk
            t = (
                colocated_step_times(run, args.steps, env_steps, stages)
                if colocated
                else step_times(run, args.steps, env_steps)
            )
            base = t["step"] if stages == 1 else base
            rows.append(
                [
                    chunk,
                    stages,
                    f"{t['env'] * 1e3:.0f} / {t['inference'] * 1e3:.0f}",
                    f"{t['step'] * 1e3:.0f}",
                    f"{t['step'] / max(t['env'], t['inference']):.2f}x",
                    f"{base / t['step']:.2f}x" if base else "-",
                    "-" if colocated else f"{t['env_idle'] * 1e3:.0f} / {t['inference_idle'] * 1e3:.0f}",
                ]
            )
            print(rows[-1], flush=True)
    print(machine())
    headers = ["chunk K", "S", "E / I measured (ms)", "step (ms)", "vs max(E, I)", "speed-up vs S=1"]
    print(table([*headers, "idle env / inference (ms)"], rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", default="1,2,4")
    parser.add_argument("--steps", type=int, default=32, help="algo.num_steps: steps per rollout")
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument("--layout", choices=["split", "colocated"], default="split")
    parser.add_argument("--env", choices=["slow", "metaworld"], default="slow", help="set sleeps, or MetaWorld")
    parser.add_argument("--chunks", default="4", help="--env metaworld: env.action_chunk values")
    args = parser.parse_args()
    stage_counts = [int(s) for s in args.stages.split(",")]
    if args.env == "metaworld":
        metaworld(args, stage_counts)
        return
    colocated = args.layout == "colocated"
    rows = []
    for name, (env_sleep, act_sleep) in (COLOCATED_SPLITS if colocated else SPLITS).items():
        env_s, inference_s = set_times(args.layout, env_sleep, act_sleep)
        base = None
        for stages in stage_counts:
            run = slow_run(stages, env_sleep, act_sleep, args.steps)
            t = (
                colocated_step_times(run, args.steps, args.iterations * args.steps * ENVS, stages)
                if colocated
                else step_times(run, args.steps, args.iterations * args.steps * ENVS * ENV_RANKS)
            )
            base = t["step"] if stages == 1 else base
            # one process: the model bound max(I, E + I / S); split: each side's idle time
            last = (
                f"{t['step'] / max(inference_s, env_s + inference_s / stages):.2f}x"
                if colocated
                else f"{t['env_idle'] * 1e3:.1f} / {t['inference_idle'] * 1e3:.1f}"
            )
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
                    last,
                ]
            )
            print(rows[-1], flush=True)
    print(machine())
    headers = [
        "split",
        "E / I set (ms)",
        "E / I measured (ms)",
        "S",
        "step (ms)",
        "vs max(E, I) set",
        "vs max(E, I) measured",
        "speed-up vs S=1",
        "vs model max(I, E + I/S) set" if colocated else "idle env / inference (ms)",
    ]
    print(table(headers, rows))


if __name__ == "__main__":
    main()
