"""What a checkpoint costs: seconds for one rank to save (write, fsync, rename) and commit, and to load, for
states the size of our recipes' (networks + Adam, RNGs, env state; SAC with its replay shard).

    python -m benchmarks.checkpoint_save [--repeats 5] [--dir /tmp]

The networks are plain MLPs of the recipes' sizes: what is measured is bytes to disk, not our module classes.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import gymnasium as gym
import torch
from gymnasium.wrappers import vector as vector_wrappers

from benchmarks.common import machine
from spmd_rl.envs.gymnasium_state import capture_env_state
from spmd_rl.persist.checkpoint import CheckpointStore, capture_rng_state


def mlp(sizes: list[int]) -> torch.nn.Sequential:
    layers = []
    for a, b in zip(sizes[:-1], sizes[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def with_adam_state(modules: list[torch.nn.Module]) -> dict:
    """The modules' weights and an Adam optimizer's state after one step (its moments are allocated)."""
    params = [p for m in modules for p in m.parameters()]
    optimizer = torch.optim.Adam(params, lr=1e-3)
    sum(p.sum() for p in params).backward()
    optimizer.step()
    return {"modules": [m.state_dict() for m in modules], "optimizer": optimizer.state_dict()}


def replay_shard(rows: int, obs_dim: int, act_dim: int) -> dict:
    return {
        "obs": torch.randn(rows, obs_dim),
        "action": torch.randn(rows, act_dim),
        "reward": torch.randn(rows),
        "next_obs": torch.randn(rows, obs_dim),
        "terminated": torch.zeros(rows, dtype=torch.bool),
        "cursor": rows,
    }


def env_state(env_id: str, num_envs: int) -> dict:
    envs = vector_wrappers.RecordEpisodeStatistics(gym.make_vec(env_id, num_envs=num_envs))
    envs.reset(seed=0)
    return capture_env_state(envs)


def states() -> dict[str, dict]:
    common = {"rng": capture_rng_state(), "iteration": 100, "env_steps": 25600}
    return {
        # configs/ppo_cartpole.yaml: actor 4-64-64-2, critic 4-64-64-1, one Adam; 8 CartPoles
        "PPO CartPole (64x64 + Adam)": {
            **common,
            "algorithm": with_adam_state([mlp([4, 64, 64, 2]), mlp([4, 64, 64, 1])]),
            "env": env_state("CartPole-v1", 8),
        },
        # configs/sac_pendulum.yaml: actor 3-256-256-2, two critics 4-256-256-1 and their targets, Adam each;
        # a full 100k-row replay shard
        "SAC Pendulum (256x256 + Adam, 100k replay)": {
            **common,
            "algorithm": {
                **with_adam_state([mlp([3, 256, 256, 2]), mlp([4, 256, 256, 1]), mlp([4, 256, 256, 1])]),
                "targets": [mlp([4, 256, 256, 1]).state_dict() for _ in range(2)],
            },
            "replay": replay_shard(100_000, 3, 1),
            "env": env_state("Pendulum-v1", 1),
        },
        # configs/sac_halfcheetah.yaml with its 1M-row memory replay: the large case
        "SAC HalfCheetah (256x256 + Adam, 1M replay)": {
            **common,
            "algorithm": with_adam_state([mlp([17, 256, 256, 12]), mlp([23, 256, 256, 1]), mlp([23, 256, 256, 1])]),
            "replay": replay_shard(1_000_000, 17, 6),
        },
    }


def size_mb(state) -> float:
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size() / 2**20
    if isinstance(state, dict):
        return sum(size_mb(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(size_mb(v) for v in state)
    return 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where to write (default: the system's temporary directory)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(machine())
    print(f"{'state':<45} {'MB':>8} {'save+commit s':>14} {'load s':>8}   (median of {args.repeats})")
    for name, state in states().items():
        with tempfile.TemporaryDirectory(dir=args.dir) as run_dir:
            store = CheckpointStore(run_dir, keep=1)
            saves, loads = [], []
            for iteration in range(args.repeats):
                start = time.perf_counter()
                store.save(state, iteration, rank=0)
                store.commit(iteration)
                saves.append(time.perf_counter() - start)
                start = time.perf_counter()
                store.load(store.latest(), rank=0)
                loads.append(time.perf_counter() - start)
        print(f"{name:<45} {size_mb(state):8.2f} {statistics.median(saves):14.4f} {statistics.median(loads):8.4f}")


if __name__ == "__main__":
    main()
