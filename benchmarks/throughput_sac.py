"""CPU time of off-policy learning (SAC and TD3 on Pendulum-v1, DQN on CartPole-v1): spmd_rl (one process)
against Stable-Baselines3 with the same hyperparameters.

    python benchmarks/throughput_sac.py [--algos sac,dqn,td3] [--steps N] [--repeats 2] [--compare-tree DIR]

sac (the default) runs configs/sac_pendulum.yaml's settings: 1 env, 1000 uniform random steps, then 8 env steps
and 8 gradient steps in turn (batch 256, 256x256 ReLU actor and twin critics, tau 0.005, gamma 0.99, temperature
tuned from 0.2), with one learning rate for everything (SB3 has one: 3e-4, so spmd_rl's q_lr is set to it). SB3
updates the actor at every gradient step, spmd_rl (as CleanRL) twice every second step: the same number of actor
steps. dqn runs configs/dqn_cartpole.yaml (256 env steps, then 128 gradient steps of batch 64) and td3
configs/td3_pendulum.yaml (8 env steps, then 8 gradient steps of batch 256, 400x300 networks), both on SB3's side
with the config's hyperparameters translated key by key by learning.py's sb3_kwargs; td3's learning starts after
1000 random steps instead of the config's 10000 (on both sides), which keeps the run short and leaves every update
the same. The configs' evaluations are off (eval.every=0): SB3 does not evaluate either.

Measured from the first step after learning starts (the start of the first segment that learns) to the end of the
run, so start-up and the random steps stay out: env steps per second of the process's CPU time (the ratio is the
table's answer) and of wall time, one torch thread each, best of --repeats runs that alternate which side goes
first. --steps: env steps per run for every algorithm, rounded up to whole segments (by default 3000 for sac and
td3, 9216 for dqn: about 2000 and 4200 gradient steps). --compare-tree DIR adds the spmd_rl of another checkout
(e.g. `git worktree add /tmp/old <commit>`), run alternately with this one: a change's before and after in one run.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from common import ROOT, machine, run_spmd, table
from learning import sb3_model

from spmd_rl.config.loading import load_config


@dataclass(frozen=True)
class Algo:
    config: str
    overrides: list[str] = field(default_factory=list)  # on both sides (SB3's through sb3_kwargs)
    spmd_only: list[str] = field(default_factory=list)  # what only spmd_rl's run needs
    steps: int = 3000  # env steps per run, by default
    learning_starts: int = 1000
    segment: int = 8  # env steps per iteration (algo.num_steps), and SB3's train_freq

    def clock_start(self, sb3: bool) -> int:
        """The env step at which the first segment that learns starts: spmd_rl learns in the segment that
        reaches learning_starts, SB3 after the first segment that passes it."""
        segments = self.learning_starts // self.segment if sb3 else math.ceil(self.learning_starts / self.segment) - 1
        return segments * self.segment

    def run_steps(self, steps: int | None) -> int:
        return math.ceil((steps or self.steps) / self.segment) * self.segment


ALGOS = {
    "sac": Algo("configs/sac_pendulum.yaml", spmd_only=["algo.q_lr=0.0003"]),
    "dqn": Algo("configs/dqn_cartpole.yaml", ["eval.every=0"], steps=9216, segment=256),
    "td3": Algo("configs/td3_pendulum.yaml", ["eval.every=0", "algo.learning_starts=1000"]),
}


def sb3_sac(seed: int):
    """SB3's SAC with sac_pendulum.yaml's settings (its two learning rates and actor schedule are not what
    sb3_kwargs translates, hence by hand)."""
    from stable_baselines3 import SAC

    return SAC(
        "MlpPolicy",
        "Pendulum-v1",
        learning_rate=3e-4,
        buffer_size=100_000,
        learning_starts=ALGOS["sac"].learning_starts,
        batch_size=256,
        tau=0.005,
        gamma=0.99,
        train_freq=(ALGOS["sac"].segment, "step"),
        gradient_steps=ALGOS["sac"].segment,
        ent_coef="auto_0.2",
        policy_kwargs=dict(net_arch=[256, 256]),
        seed=seed,
        device="cpu",
    )


def sb3_sps(name: str, steps: int, seed: int) -> tuple[float, float]:
    """(SPS over wall time, SPS over CPU time) of SB3's learn() from the first segment that learns."""
    from stable_baselines3.common.callbacks import BaseCallback

    algo = ALGOS[name]
    torch.set_num_threads(1)
    start_at = algo.clock_start(sb3=True)

    class LearningClock(BaseCallback):
        """The clocks when the last segment that does not learn ends."""

        def _on_step(self) -> bool:
            if self.num_timesteps == start_at:
                self.start = (self.num_timesteps, time.perf_counter(), time.process_time())
            return True

    if name == "sac":
        model = sb3_sac(seed)
    else:
        model, _ = sb3_model(load_config(str(ROOT / algo.config), algo.overrides), seed)
    clock = LearningClock()
    model.learn(total_timesteps=steps, callback=clock)
    wall, cpu = time.perf_counter(), time.process_time()
    first_step, first_wall, first_cpu = clock.start
    learned = model.num_timesteps - first_step
    return learned / (wall - first_wall), learned / (cpu - first_cpu)


def spmd_sps(name: str, steps: int, seed: int, root: Path | None = None) -> tuple[float, float]:
    """(SPS over wall time, SPS over CPU time) of spmd_rl after its last iteration of random steps only (the
    iteration that reaches learning_starts already learns)."""
    algo = ALGOS[name]
    overrides = algo.overrides + algo.spmd_only + [f"train.total_steps={steps}", f"train.seed={seed}"]
    records = run_spmd(overrides, config=algo.config, **({"root": root} if root else {}))
    first = next(r for r in records if r["env_steps"] >= algo.clock_start(sb3=False))
    learned = records[-1]["env_steps"] - first["env_steps"]
    return learned / (records[-1]["wall_s"] - first["wall_s"]), learned / (records[-1]["cpu_s"] - first["cpu_s"])


def compare_with_sb3(names: list[str], steps: int | None, repeats: int, other_tree: Path | None) -> None:
    ours, theirs, other = ({name: [] for name in names} for _ in range(3))
    loads = [os.getloadavg()[0]]
    for repeat in range(repeats):  # alternating, so a change in the machine's load hits every side alike
        for name in names:
            run_steps = ALGOS[name].run_steps(steps)
            sides = [(ours[name], None), *([(other[name], other_tree)] if other_tree else []), (theirs[name], "sb3")]
            for results, where in sides if repeat % 2 == 0 else sides[::-1]:
                if where == "sb3":
                    results.append(sb3_sps(name, run_steps, seed=1))
                else:
                    results.append(spmd_sps(name, run_steps, seed=1, root=where))
    loads.append(os.getloadavg()[0])
    rows = []
    for name in names:
        (wall_ours, cpu_ours), (wall_theirs, cpu_theirs) = _best(ours[name]), _best(theirs[name])
        algo = ALGOS[name]
        row = [
            algo.run_steps(steps) - algo.learning_starts,
            f"{loads[0]:.1f} -> {loads[1]:.1f}",
            f"{cpu_theirs:.1f}",
            f"{cpu_ours:.1f}",
            f"{cpu_ours / cpu_theirs:.2f}x",
            f"{wall_theirs:.1f}",
            f"{wall_ours:.1f}",
            f"{wall_ours / wall_theirs:.2f}x",
        ]
        if other_tree:
            wall_other, cpu_other = _best(other[name])
            row += [f"{cpu_other:.1f}", f"{cpu_other / cpu_theirs:.2f}x", f"{wall_other / wall_theirs:.2f}x"]
        rows.append([name, *row] if len(names) > 1 else row)
    headers = [
        "learning steps",
        "load average",
        "SB3 SPS (CPU)",
        "spmd_rl SPS (CPU)",
        "ratio (CPU)",
        "SB3 SPS",
        "spmd_rl SPS",
        "ratio",
    ]
    if other_tree:
        headers += [f"{other_tree} SPS (CPU)", "its ratio (CPU)", "its ratio"]
    print(f"best of {repeats} runs each, alternating; env steps per second after learning starts")
    print(table(["algorithm", *headers] if len(names) > 1 else headers, rows))


def _best(results: list[tuple[float, float]]) -> tuple[float, float]:
    return max(r[0] for r in results), max(r[1] for r in results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algos", default="sac", help="comma-separated: sac, dqn, td3")
    parser.add_argument("--steps", type=int, default=None, help="env steps per run (default: 3000, dqn 9216)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--compare-tree", type=Path, default=None, help="another checkout to measure alongside")
    args = parser.parse_args()
    names = [name.strip() for name in args.algos.split(",") if name.strip()]
    unknown = [name for name in names if name not in ALGOS]
    if unknown or not names:
        raise SystemExit(f"--algos: {','.join(unknown) or 'none'} not among {', '.join(ALGOS)}")
    print(f"machine: {machine()}")
    compare_with_sb3(names, args.steps, args.repeats, args.compare_tree)


if __name__ == "__main__":
    main()
