"""PPO CartPole throughput against CleanRL's ppo.py at CleanRL's own settings, alternating runs in one sitting.

    python benchmarks/cleanrl_ppo.py --cleanrl /path/to/cleanrl/ppo.py [--steps 51200] [--repeats 2]

ppo.py is CleanRL's single-file PPO (not shipped here: check out github.com/vwxyzjn/cleanrl and point at
cleanrl/ppo.py; it needs `pip install tyro`). Both run one torch thread on CartPole-v1 with CleanRL's defaults:
4 envs x 128 steps, 4 minibatches, 4 epochs, lr 2.5e-4 annealed, gamma 0.99, GAE lambda 0.95, clip 0.2 (not
annealed), value-loss clipping, entropy 0.01, vf 0.5, max grad norm 0.5, 64x64 tanh actor and critic. Each
command's whole CPU time (start-up included) and wall time are measured from outside; CPU-SPS = env steps / CPU s.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, machine, table

SPMD_OVERRIDES = [
    "env.num_envs=4",
    "algo.num_steps=128",
    "algo.num_minibatches=4",
    "algo.update_epochs=4",
    "algo.learning_rate=2.5e-4",
    "algo.anneal_lr=true",
    "algo.gamma=0.99",
    "algo.gae_lambda=0.95",
    "algo.clip_coef=0.2",
    "algo.anneal_clip=false",
    "algo.clip_value_loss=true",
    "algo.ent_coef=0.01",
    "algo.vf_coef=0.5",
    "algo.max_grad_norm=0.5",
    "policy.hidden_sizes=[64,64]",
    "policy.activation=tanh",
]


def timed(cmd: list[str], cwd: Path) -> tuple[float, float]:
    """(wall s, CPU s of the command and its children)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    clock = time.perf_counter()
    result = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=3600)
    wall = time.perf_counter() - clock
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{result.stderr[-2000:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cleanrl", type=Path, required=True, help="CleanRL's cleanrl/ppo.py")
    parser.add_argument("--steps", type=int, default=51200)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    print(machine())
    print(f"load average before: {os.getloadavg()}")
    work = Path(tempfile.mkdtemp(prefix="cleanrl_bench_"))
    cleanrl = [sys.executable, str(args.cleanrl.resolve()), f"--total-timesteps={args.steps}", "--seed=1"]
    ours = [
        sys.executable,
        "-m",
        "spmd_rl.main",
        *SPMD_OVERRIDES,
        f"train.total_steps={args.steps}",
        "train.seed=1",
        "log.progress=false",
        "log.tensorboard=false",
        "log.interval_s=1000000",
    ]
    results: dict[str, list[tuple[float, float]]] = {"CleanRL ppo.py": [], "spmd_rl": []}
    for repeat in range(args.repeats):  # alternating: both see the same machine
        results["CleanRL ppo.py"].append(timed(cleanrl, work))
        results["spmd_rl"].append(timed([*ours, f"run.dir={work / f'spmd{repeat}'}"], ROOT))
    rows = []
    best = {name: min(runs, key=lambda r: r[1]) for name, runs in results.items()}
    for name, (wall, cpu) in best.items():
        rows.append(
            [name, args.steps, f"{wall:.1f}", f"{cpu:.1f}", f"{args.steps / cpu:.0f}", f"{args.steps / wall:.0f}"]
        )
    ratio_cpu = best["CleanRL ppo.py"][1] / best["spmd_rl"][1]
    ratio_wall = best["CleanRL ppo.py"][0] / best["spmd_rl"][0]
    print(f"best of {args.repeats} alternating runs each (start-up included)")
    print(table(["", "env steps", "wall s", "CPU s", "CPU-SPS", "wall SPS"], rows))
    print(f"spmd_rl / CleanRL: {ratio_cpu:.2f}x CPU-SPS, {ratio_wall:.2f}x wall SPS")
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
