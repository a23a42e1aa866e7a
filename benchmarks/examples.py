"""The examples learning: each run as a user would (its folder copied elsewhere, `python -m spmd_rl.main --config`
from inside the copy, under torchrun for several ranks), to its full budget, per seed and layout.

    python benchmarks/examples.py [--seeds 3] [--examples pixel_catch,a2c] [--layouts one,colocated2,split4]
    python benchmarks/examples.py --examples frozen_encoder --layouts split5,split5-fsdp [--seeds 1]

Every layout runs the same number of envs in all (the example's env.num_envs shared by its env ranks), so an
iteration is the same batch in each. An example with a preparation script (frozen_encoder's make_encoder.py, which
writes its "pretrained" encoder) runs it in the copy first, as its README says. frozen_encoder is the second policy
of examples/pixel_catch (its frozen_catch.yaml).

Returns are the mean of the last 20 episodes (the metrics' episode_return_mean); "steps to target" is the first
iteration where it reaches the example's stated return.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from common import ROOT, command, machine, table

# name: (config file, stated return, budget in env steps, envs in all (the config's env.num_envs or total_envs))
EXAMPLES = {
    "pixel_catch": ("catch.yaml", 0.8, 40_000, 16),  # +1 per catch, -1 per miss; random play averages about -0.6
    "a2c": ("a2c_cartpole.yaml", 475.0, 200_000, 8),  # CartPole-v1's "solved"; random play averages about 22
    "frozen_encoder": ("frozen_catch.yaml", 0.8, 40_000, 16),  # pixel Catch again, with a frozen pretrained encoder
}
# Scripts an example's README runs in its folder before training.
PREPARE = {"frozen_encoder": ["make_encoder.py"]}
# An example that is another config of a folder named otherwise.
FOLDERS = {"frozen_encoder": "pixel_catch"}
# layout: (torchrun processes (0 = plain python), env ranks, overrides)
LAYOUTS = {
    "one": (0, 1, []),
    "colocated2": (2, 2, []),
    "split4": (4, 2, ["layout.mode=split", "layout.trainer=1", "layout.inference=1", "layout.env=2"]),
    # 2 trainers need 2 env ranks (a trainer learns from its own env ranks' data): 5 processes.
    "split5": (5, 2, ["layout.mode=split", "layout.trainer=2", "layout.inference=1", "layout.env=2"]),
    "split5-fsdp": (
        5,
        2,
        ["layout.mode=split", "layout.trainer=2", "layout.inference=1", "layout.env=2", "train.parallel=fsdp"],
    ),
}


def run_example(name: str, layout: str, seed: int) -> list[dict]:
    config, _, budget, num_envs = EXAMPLES[name]
    nproc, env_ranks, layout_overrides = LAYOUTS[layout]
    work = Path(tempfile.mkdtemp(prefix=f"spmd_example_{name}_"))
    folder = work / name
    source = ROOT / "examples" / FOLDERS.get(name, name)
    shutil.copytree(source, folder, ignore=shutil.ignore_patterns("__pycache__", "runs"))
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    for script in PREPARE.get(name, []):
        subprocess.run(command(script=script), cwd=folder, env=env, check=True, capture_output=True, timeout=600)
    launcher = command("torchrun", nproc) if nproc else command("none")
    cmd = [
        *launcher,
        "--config",
        config,
        *layout_overrides,
        f"env.num_envs={num_envs // env_ranks}",
        f"train.seed={seed}",
        f"train.total_steps={budget}",
        f"run.dir={work / 'run'}",
        "log.progress=false",
        "log.tensorboard=false",
        "log.interval_s=1000000",
    ]
    result = subprocess.run(cmd, cwd=folder, env=env, capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} in {folder} failed ({result.returncode}):\n{result.stderr[-3000:]}")
    records = [json.loads(line) for line in (work / "run" / "metrics.jsonl").read_text().splitlines()]
    shutil.rmtree(work)
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--examples", default=",".join(EXAMPLES))
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    args = parser.parse_args()
    print(f"machine: {machine()}")
    rows = []
    for name in args.examples.split(","):
        target = EXAMPLES[name][1]
        for layout in args.layouts.split(","):
            for seed in range(1, args.seeds + 1):
                records = run_example(name, layout, seed)
                reached = next((r for r in records if (r["episode_return_mean"] or float("-inf")) >= target), None)
                last = records[-1]
                rows.append(
                    [
                        name,
                        layout,
                        f">= {target:g}",
                        seed,
                        last["env_steps"],
                        f"{last['episode_return_mean']:.2f}",
                        reached["env_steps"] if reached else "not reached",
                        f"{reached['wall_s']:.1f}" if reached else "-",
                        f"{last['wall_s']:.1f}",
                    ]
                )
                print(f"{name} {layout} seed {seed} done", flush=True)
    print(
        table(
            [
                "example",
                "layout",
                "target return",
                "seed",
                "env steps",
                "final return",
                "env steps to target",
                "wall s to target",
                "wall s",
            ],
            rows,
        )
    )


if __name__ == "__main__":
    main()
