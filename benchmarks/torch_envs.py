"""Env backends side by side: the example torch backend (examples/torch_cartpole: CartPole in torch, a rank's envs
one batch of tensors) against gymnasium's numpy-vectorized CartPole-v1 (CartPoleVectorEnv), at 1024-4096 envs, in
one run: env-only steps per second (random actions through each backend's vector env, as the env runner steps it)
and end-to-end steps per second (PPO in one process, `python -m spmd_rl.main`).

    python benchmarks/torch_envs.py [--envs 1024 4096] [--seconds 3] [--iterations 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
import torch
from common import ROOT, machine, run_spmd, table

EXAMPLE = ROOT / "examples" / "torch_cartpole"
sys.path[:0] = [str(ROOT), str(EXAMPLE)]
from spmd_rl.config.loading import load_config  # noqa: E402
from spmd_rl.envs.vector import make_vector_env, probe_env  # noqa: E402

TORCH_BACKEND = ["env.id=TorchCartPole-v0", "env.backend=torch_cartpole:TorchCartPoleBackend"]
GYMNASIUM = ["env.id=CartPole-v1", "env.backend=gymnasium"]
BACKENDS = {"torch (example)": TORCH_BACKEND, "gymnasium CartPoleVectorEnv": GYMNASIUM}


def env_only(overrides: list[str], num_envs: int, seconds: float) -> float:
    cfg = load_config(None, [*overrides, f"env.num_envs={num_envs}"]).env
    envs, _ = make_vector_env(cfg, probe_env(cfg), seed=0)
    rng = np.random.default_rng(0)
    actions = [rng.integers(0, 2, size=num_envs) for _ in range(64)]
    steps, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        envs.step(actions[steps % 64])
        steps += 1
    rate = steps * num_envs / (time.perf_counter() - start)
    envs.close()
    return rate


def end_to_end(overrides: list[str], num_envs: int, iterations: int) -> float:
    steps = 16
    records = run_spmd(
        [
            *overrides,
            f"env.num_envs={num_envs}",
            f"algo.num_steps={steps}",
            "algo.num_minibatches=4",
            "algo.update_epochs=1",
            f"train.total_steps={steps * num_envs * iterations}",
        ],
        user_code=EXAMPLE,
    )
    return statistics.median(r["sps"] for r in records[1:])  # the first iteration pays the start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--envs", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--seconds", type=float, default=3.0, help="env-only time per measurement")
    parser.add_argument("--iterations", type=int, default=3, help="PPO iterations per end-to-end run")
    args = parser.parse_args()
    torch.set_num_threads(1)  # as the runs below (OMP_NUM_THREADS=1): one core per backend, compared alike
    rows = []
    for num_envs in args.envs:
        for name, overrides in BACKENDS.items():
            rows.append(
                [
                    name,
                    num_envs,
                    f"{env_only(overrides, num_envs, args.seconds):,.0f}",
                    f"{end_to_end(overrides, num_envs, args.iterations):,.0f}",
                ]
            )
    print(machine())
    print(table(["backend", "envs", "env-only steps/s", "end-to-end steps/s (PPO, one process)"], rows))


if __name__ == "__main__":
    main()
