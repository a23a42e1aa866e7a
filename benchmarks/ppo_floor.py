"""PPO's arithmetic floor on CartPole-v1, and spmd_rl's CPU time per env step against it.

    python benchmarks/ppo_floor.py [--envs 8] [--steps 32] [--repeats 3] [--compare-tree DIR] [--floor-only]

The floor is the arithmetic of PPO measured alone, each part in its own loop, one torch thread:
- env: gymnasium's sync vector env stepping (random actions, as numpy);
- act: one forward of spmd_rl's actor-critic per step (its `act`, under no_grad, on the step's observations);
- update: GAE over the rollout, then epochs x minibatches of a shuffle, the actor-critic's `evaluate`, a plain
  clipped-surrogate + value loss (advantages normalized per minibatch), backward, torch's clip_grad_norm_ (foreach)
  and fused Adam, with the hyperparameters of the default config (20 epochs x 2 minibatches).
Its sum is what any PPO of this network and env must pay; spmd_rl's ratio to it is the framework's overhead.

spmd_rl is measured as a user runs it (`python -m spmd_rl.main`, a subprocess, the default config at --envs x
--steps) from its metrics: CPU seconds per env step between the first and the last iteration (start-up excluded).
Each repeat runs the floor, this checkout and (with --compare-tree) another checkout back to back, so a change's
before and after share the machine's load; the table reports medians and the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import machine, run_spmd, table

EPOCHS, MINIBATCHES, LR, CLIP, VF_COEF, MAX_GRAD_NORM = 20, 2, 1e-3, 0.2, 0.5, 0.5


def cpu_us_per_step(body, iterations: int, steps_per_iteration: int) -> float:
    """CPU µs per env step of body() run `iterations` times (after one warm-up call)."""
    body()
    start = time.process_time()
    for _ in range(iterations):
        body()
    return (time.process_time() - start) / (iterations * steps_per_iteration) * 1e6


def floor(num_envs: int, num_steps: int, iterations: int) -> dict[str, float]:
    """CPU µs per env step of each part of PPO's arithmetic, and their sum."""
    import gymnasium as gym
    import numpy as np
    import torch

    from spmd_rl.algorithms.ppo import compute_gae
    from spmd_rl.modules.actor_critic import ActorCritic
    from spmd_rl.modules.configs import ActorCriticConfig

    torch.set_num_threads(1)
    torch.manual_seed(0)
    envs = gym.make_vec("CartPole-v1", num_envs=num_envs, vectorization_mode="sync")
    obs, _ = envs.reset(seed=0)
    rng = np.random.default_rng(0)

    def env_steps():
        for _ in range(num_steps):
            envs.step(rng.integers(0, 2, num_envs))

    policy = ActorCritic(envs.single_observation_space, envs.single_action_space, ActorCriticConfig())
    obs_t = torch.as_tensor(obs, dtype=torch.float32)

    def act_steps():
        with torch.no_grad():
            for _ in range(num_steps):
                policy.act(obs_t)

    size = num_envs * num_steps
    batch_obs = torch.randn(size, obs.shape[1])
    batch_action = torch.randint(0, 2, (size,))
    with torch.no_grad():
        out = policy.act(batch_obs)
    old_log_prob = out["log_prob"]
    rewards, values = torch.ones(num_steps, num_envs), out["value"].reshape(num_steps, num_envs)
    terminated = torch.rand(num_steps, num_envs) < 0.05
    truncated = torch.zeros(num_steps, num_envs, dtype=torch.bool)
    parameters = list(policy.parameters())
    optimizer = torch.optim.Adam(parameters, lr=LR, eps=1e-5, fused=True)

    def update():
        advantage, return_ = compute_gae(rewards, values, values[-1], terminated, truncated, 0.98, 0.8)
        advantage, return_ = advantage.reshape(-1), return_.reshape(-1)
        for _ in range(EPOCHS):
            for rows in torch.randperm(size).chunk(MINIBATCHES):
                log_prob, _, value = policy.evaluate(batch_obs[rows], batch_action[rows])
                adv = advantage[rows]
                adv = (adv - adv.mean()) / (adv.std() + 1e-8)
                ratio = (log_prob - old_log_prob[rows]).exp()
                policy_loss = -torch.min(adv * ratio, adv * ratio.clamp(1 - CLIP, 1 + CLIP)).mean()
                loss = policy_loss + VF_COEF * (value - return_[rows]).square().mean()
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(parameters, MAX_GRAD_NORM, foreach=True)
                optimizer.step()

    parts = {
        "env": cpu_us_per_step(env_steps, iterations, num_steps * num_envs),
        "act": cpu_us_per_step(act_steps, iterations, num_steps * num_envs),
        "update": cpu_us_per_step(update, iterations, num_steps * num_envs),
    }
    parts["floor"] = sum(parts.values())
    return parts


def floor_in_subprocess(args) -> dict[str, float]:
    """The floor in a fresh process (as the spmd_rl runs it alternates with), parsed from its JSON line."""
    cmd = [sys.executable, __file__, "--floor-only", f"--envs={args.envs}", f"--steps={args.steps}"]
    cmd.append(f"--iterations={args.iterations}")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env, check=True)
    return json.loads(result.stdout.splitlines()[-1])


def spmd_us_per_step(args, root: Path | None) -> float:
    """spmd_rl's steady-state CPU µs per env step (first to last iteration) at --envs x --steps."""
    overrides = [f"env.num_envs={args.envs}", f"algo.num_steps={args.steps}", f"train.total_steps={args.total}"]
    records = run_spmd(overrides, **({"root": root} if root else {}))
    first, last = records[0], records[-1]
    return (last["cpu_s"] - first["cpu_s"]) / (last["env_steps"] - first["env_steps"]) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--envs", type=int, default=8)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--iterations", type=int, default=40, help="floor: iterations timed per part")
    parser.add_argument("--total", type=int, default=20000, help="spmd_rl: train.total_steps")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compare-tree", type=Path, help="another checkout, run alternately with this one")
    parser.add_argument("--floor-only", action="store_true", help="print the floor's parts as one JSON line")
    args = parser.parse_args()
    if args.floor_only:
        print(json.dumps(floor(args.envs, args.steps, args.iterations)))
        return
    floors, ours, theirs = [], [], []
    for repeat in range(args.repeats):
        floors.append(floor_in_subprocess(args))
        if args.compare_tree:
            theirs.append(spmd_us_per_step(args, args.compare_tree))
        ours.append(spmd_us_per_step(args, None))
        print(f"repeat {repeat}: floor {floors[-1]}, this {ours[-1]:.1f}, other {theirs[-1:]}", flush=True)
    parts = {key: statistics.median(f[key] for f in floors) for key in floors[0]}
    print(machine())
    print(f"load average {os.getloadavg()}; {args.envs} envs x {args.steps} steps, medians of {args.repeats}")
    rows = [[f"floor: {key}", f"{value:.0f}", ""] for key, value in parts.items()]
    mine = statistics.median(ours)
    rows.append(["spmd_rl (this checkout)", f"{mine:.0f}", f"{mine / parts['floor']:.2f}x"])
    if theirs:
        other = statistics.median(theirs)
        rows.append([f"spmd_rl ({args.compare_tree})", f"{other:.0f}", f"{other / parts['floor']:.2f}x"])
        pairs = [f"{a / b:.2f}" for a, b in zip(ours, theirs)]
        print(f"this / other per repeat: {', '.join(pairs)}")
    print(table(["measure", "CPU µs / env step", "vs floor"], rows))


if __name__ == "__main__":
    main()
