"""Recurrent PPO on CartPole with its velocities hidden (configs/ppo_cartpole_recurrent.yaml), against the
feed-forward PPO of configs/ppo_cartpole.yaml on the same task, per seed and layout.

    python benchmarks/recurrent.py [--seeds 1,2,3] [--policies recurrent,feedforward] [--layouts one,colocated2,split4]
                                   [--total-steps N]

Every layout runs the same number of envs in all (the config's 8 shared by the env ranks), so an iteration is the
same batch in each. Returns are the mean of the last 20 episodes (episode_return_mean); "env steps to 475" is the
first iteration where it reaches CartPole-v1's "solved" return.
"""

from __future__ import annotations

import argparse

from common import machine, run_spmd, table

TARGET = 475.0
MASKED_ENV = "examples.recurrent_cartpole.masked_cartpole:MaskedCartPole-v1"
NUM_ENVS = 8
# policy: (config, overrides)
POLICIES = {
    "recurrent": ("configs/ppo_cartpole_recurrent.yaml", []),
    "feedforward": ("configs/ppo_cartpole.yaml", [f"env.id={MASKED_ENV}"]),
}
# layout: (torchrun processes (0 = plain python), env ranks, overrides)
LAYOUTS = {
    "one": (0, 1, []),
    "colocated2": (2, 2, []),
    "split4": (4, 2, ["layout.mode=split", "layout.trainer=1", "layout.inference=1", "layout.env=2"]),
    # at a policy lag of up to 2 versions, corrected by V-trace (without algo.vtrace the lag is 0: the sync result)
    "async4": (
        4,
        2,
        [
            "layout.mode=split",
            "layout.trainer=1",
            "layout.inference=1",
            "layout.env=2",
            "engine.class=async",
            "engine.max_policy_lag=2",
            "algo.vtrace=true",
        ],
    ),
}


def run(policy: str, layout: str, seed: int, total_steps: int | None) -> list[dict]:
    config, overrides = POLICIES[policy]
    nproc, env_ranks, layout_overrides = LAYOUTS[layout]
    steps = [f"train.total_steps={total_steps}"] if total_steps else []
    settings = [*overrides, *layout_overrides, f"env.num_envs={NUM_ENVS // env_ranks}", f"train.seed={seed}", *steps]
    return run_spmd(settings, nproc=nproc, config=config, timeout=3600)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="1,2,3", help="comma-separated seeds")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--layouts", default="one")
    parser.add_argument("--total-steps", type=int, default=None, help="the configs' own budgets when not given")
    args = parser.parse_args()
    print(f"machine: {machine()}")
    rows = []
    for policy in args.policies.split(","):
        for layout in args.layouts.split(","):
            for seed in [int(seed) for seed in args.seeds.split(",")]:
                records = run(policy, layout, seed, args.total_steps)
                returns = [r["episode_return_mean"] for r in records if r["episode_return_mean"] is not None]
                reached = next((r for r in records if (r["episode_return_mean"] or float("-inf")) >= TARGET), None)
                last = records[-1]
                rows.append(
                    [
                        policy,
                        layout,
                        seed,
                        last["env_steps"],
                        f"{last['episode_return_mean']:.1f}",
                        f"{max(returns):.1f}",
                        reached["env_steps"] if reached else "not reached",
                        f"{reached['wall_s']:.0f}" if reached else "-",
                        f"{last['wall_s']:.0f}",
                    ]
                )
                print(f"{policy} {layout} seed {seed}: {rows[-1]}", flush=True)
    headers = ["policy", "layout", "seed", "env steps", "final return", "best return", "env steps to 475"]
    print(table([*headers, "wall s to 475", "wall s"], rows))


if __name__ == "__main__":
    main()
