"""bc (behaviour cloning) on a scripted expert's demonstrations of examples/instructed_reach, then GRPO from it.

    python benchmarks/bc_reach.py [--rollouts 4] [--envs 16] [--decisions 16] [--seeds 3] [--rl-steps 0]

1. The expert (it reads the target from the instruction's byte tokens and steps straight at it) acts on `--envs` of
   the example's envs (env.action_chunk 4) for `--rollouts` rollouts of `--decisions` decisions (an episode is a
   decision and its reset step: the expert's first chunk reaches the target); every rollout is appended to an
   experience file (tests/harness/demos.py: the framework's own env runner and inference server), the
   demonstrations. Its own success rate is printed beside them.
2. The example's bc.yaml learns from them (no rollouts), per seed; its evaluations (100 deterministic episodes every
   10 iterations) give eval_success_rate.
3. With `--rl-steps N`, grpo.yaml runs N env steps from each bc run's weights (run.init_from); its success is the
   per-iteration success_rate averaged over 5 iterations (160 episodes), first and last.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import h5py
import numpy as np
import torch
from common import ROOT, machine, run_spmd, table, versions_line
from harness.demos import ScriptedExpert, chunk_towards, collect
from instructed_reach import windowed_success

FOLDER = ROOT / "examples" / "instructed_reach"
sys.path.insert(0, str(FOLDER))  # the example's env module, as its folder being the working directory gives it

from reach_env import TARGETS  # noqa: E402 (after the path it is found on)

SPEED = 0.2  # the env's default speed: each step moves the tip by SPEED x the velocity
ENV = [
    "env.id=reach_env:InstructedReach-v0",
    "env.action_chunk=4",
    "env.max_episode_steps=16",
    "env.max_text_tokens=24",
]


class ReachEnvExpert(ScriptedExpert):
    """Each velocity of a chunk points straight at the named target (at most 1 per axis), from where the chunk's
    earlier ones took the tip."""

    def actions(self, obs) -> torch.Tensor:
        ids, mask = obs["instruction"]["ids"].numpy(), obs["instruction"]["mask"].numpy().astype(bool)
        colours = [bytes(row[keep]).decode().split()[2] for row, keep in zip(ids, mask)]  # "reach the red target"
        targets = np.array([TARGETS[colour][0] for colour in colours], dtype=np.float32)
        return chunk_towards(targets, obs["state"].numpy(), SPEED, self.action_space.shape[0])  # velocities


def expert_success(path: Path) -> tuple[int, int, float]:
    """(episodes ended, decisions, success rate) of the demonstrations."""
    with h5py.File(path, "r") as file:
        done = file["data/episode_done"][:]
        return int(done.sum()), int(file["data/valid"][:].sum()), float(file["data/episode_success"][:][done].mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rollouts", type=int, default=4, help="rollouts the expert acts (default 4)")
    parser.add_argument("--envs", type=int, default=16, help="envs the expert acts on (default 16)")
    parser.add_argument("--decisions", type=int, default=16, help="decisions per env per rollout (default 16)")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--rl-steps", type=int, default=0, help="env steps of grpo.yaml from each bc run (0: none)")
    args = parser.parse_args()
    print(f"machine: {machine()}; load average at start {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(versions_line())
    work = Path(tempfile.mkdtemp(prefix="spmd_bc_"))
    shape = [f"env.num_envs={args.envs}", f"algo.num_steps={args.decisions}"]
    demos = collect(work / "demos", [*ENV, *shape], ReachEnvExpert, args.rollouts)
    episodes, decisions, success = expert_success(demos)
    print(f"demonstrations: {episodes} episodes, {decisions} decisions, expert success {success:.2f} ({demos})")
    rows = []
    for seed in range(1, args.seeds + 1):
        bc_dir = work / f"bc{seed}"
        records = run_spmd(
            [f"algo.demos={demos}", f"train.seed={seed}"],
            config=str(FOLDER / "bc.yaml"),
            user_code=FOLDER,
            run_dir=bc_dir,
        )
        evaluations = [f"{r['eval_success_rate']:.2f}" for r in records if "eval_success_rate" in r]
        row = [seed, f"{records[0]['nll_loss']:.2f} -> {records[-1]['nll_loss']:.2f}", " / ".join(evaluations)]
        if args.rl_steps:
            rl = run_spmd(
                [f"run.init_from={bc_dir}", f"train.total_steps={args.rl_steps}", f"train.seed={seed}"],
                config=str(FOLDER / "grpo.yaml"),
                user_code=FOLDER,
            )
            success_over_time = windowed_success(rl)
            row += [f"{success_over_time[0][1]:.2f} -> {success_over_time[-1][1]:.2f} at {rl[-1]['env_steps']:,}"]
        rows.append(row)
    headers = ["seed", "bc nll_loss first -> last", "bc eval_success_rate per evaluation"]
    print(table(headers + (["GRPO from bc: success first -> last"] if args.rl_steps else []), rows))


if __name__ == "__main__":
    main()
