"""The program every rank runs: `python -m spmd_rl.main [--config FILE] [section.key=value ...]`.

Everything a user can get wrong is checked before any process group exists (config, layout, env id, spaces), so
bad input ends every rank with exit code 2 and one line, never a hang or a traceback.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from spmd_rl import engine
from spmd_rl.config import Config, describe_schema, load_config
from spmd_rl.envs import probe_env
from spmd_rl.errors import COMM_ERROR_EXIT_CODE, USER_ERROR_EXIT_CODE, CommError, UserError
from spmd_rl.launch import detect_launch
from spmd_rl.runtime import Runtime, shutdown_runtime, start_runtime
from spmd_rl.topology import build_topology, create_process_groups

USAGE_EXAMPLES = """\
examples:
  python -m spmd_rl.main                                    # PPO on CartPole-v1 in one process
  python -m spmd_rl.main --config configs/ppo_pendulum.yaml train.total_steps=200000
  torchrun --standalone --nproc_per_node=8 -m spmd_rl.main --config configs/ppo_cartpole_split.yaml

config sections and keys (override any with section.key=value):
"""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m spmd_rl.main",
        description="Train a policy with spmd_rl. Every rank runs this same program (torchrun, mpirun, srun, or "
                    "one process).",
        epilog=USAGE_EXAMPLES + describe_schema(),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", metavar="FILE", help="YAML config (default: the embedded PPO CartPole-v1 "
                        "config, the same as configs/ppo_cartpole.yaml)")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Everything a user can get wrong, checked before any process group exists. The config and the layout are
    # the same on every rank, so rank 0 speaks for all; the launch variables and the env (its packages, its
    # files) belong to a host, so every rank that fails says so itself.
    try:
        cfg = load_config(args.config, args.overrides)
        launch = detect_launch()
    except UserError as exc:
        return _user_error(exc, speaker=True)
    try:
        topology = build_topology(cfg.layout, launch.world_size)
        plan = engine.plan_run(cfg, topology)
    except UserError as exc:
        return _user_error(exc, speaker=launch.rank == 0)
    try:
        spec = probe_env(cfg.env)
        engine.make_policy(cfg, spec)  # spaces the algorithm cannot handle fail here
    except UserError as exc:
        return _user_error(exc, speaker=True, rank=launch.rank if launch.world_size > 1 else None)

    torch.set_num_threads(cfg.train.torch_threads)
    runtime = None
    exit_code = 0
    try:
        runtime = start_runtime(launch, cfg.train.device, cfg.dist.timeout_s)
        run_dir = _agree_on_run(cfg, runtime)
        if runtime.rank == 0:
            print(f"spmd_rl: launcher {launch.launcher}, backend {runtime.backend}, device {runtime.device}; "
                  f"{plan.describe(cfg, launch.world_size, _layout_name(topology))}; run directory {run_dir}",
                  flush=True)
        groups = create_process_groups(topology, runtime.timeout)
        engine.run(cfg, plan, runtime, topology, groups, spec, run_dir)
    except UserError as exc:  # found while running (a rank's files, a config that differs): say which rank
        exit_code = _user_error(exc, speaker=True, rank=launch.rank)
    except CommError as exc:
        print(f"spmd_rl: rank {launch.rank}: communication error: {exc}", file=sys.stderr, flush=True)
        exit_code = COMM_ERROR_EXIT_CODE
    except KeyboardInterrupt:
        print(f"spmd_rl: rank {launch.rank}: interrupted", file=sys.stderr, flush=True)
        exit_code = 130
    except Exception:
        print(f"spmd_rl: rank {launch.rank} failed:", file=sys.stderr)
        traceback.print_exc()
        exit_code = 1
    finally:
        shutdown_runtime(runtime, exit_code)
    return exit_code


def _user_error(exc: UserError, speaker: bool, rank: int | None = None) -> int:
    if speaker:
        where = f"rank {rank}: " if rank is not None else ""
        print(f"spmd_rl: {where}error: {exc}", file=sys.stderr, flush=True)
    return USER_ERROR_EXIT_CODE


def _layout_name(topology) -> str:
    if topology.colocated:
        return "colocated"
    return (f"split (trainer {len(topology.trainer_ranks)}, inference {len(topology.inference_ranks)}, "
            f"env {len(topology.env_ranks)})")


def _agree_on_run(cfg: Config, runtime: Runtime) -> Path:
    """Rank 0 names the run directory; every rank checks it runs rank 0's exact config; rank 0 saves it."""
    run_dir = cfg.run.dir or f"runs/{cfg.run.name}-{datetime.datetime.now():%Y%m%d-%H%M%S}"
    if runtime.distributed:
        shared = [run_dir]
        dist.broadcast_object_list(shared, src=0)  # once, at start-up: the only pickled message of a run
        run_dir = shared[0]
    cfg.run.dir = run_dir
    if runtime.distributed:
        mine = torch.frombuffer(bytearray.fromhex(cfg.digest()), dtype=torch.uint8)
        digests = [torch.empty_like(mine) for _ in range(runtime.world_size)]
        dist.all_gather(digests, mine)
        differing = [r for r, d in enumerate(digests) if not torch.equal(d, digests[0])]
        if differing:
            raise UserError(f"rank(s) {differing} run a different config than rank 0 (config hash differs); "
                            f"give every rank the same --config file and the same overrides")
    path = Path(run_dir)
    if runtime.rank == 0:
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.yaml").write_text(cfg.to_yaml())
    return path


if __name__ == "__main__":
    sys.exit(main())
