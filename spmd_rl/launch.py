"""How was this process started? Each launch source reads the environment it leaves behind.

Sources are tried in precedence order; the first one whose variables are present wins:
  1. torchrun   RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT (also under `srun torchrun`, whose workers
                inherit the agent's SLURM_PROCID: RANK must win over Slurm's variables)
  2. none       no launcher: one process, world size 1, no process group needed
A source that finds some of its variables but not all raises a UserError naming the missing ones.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Mapping

from spmd_rl.errors import UserError


@dataclass(frozen=True)
class LaunchInfo:
    launcher: str          # "torchrun", "none", ...
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    init_method: str       # URL for torch.distributed.init_process_group ("" when world_size == 1)

    @property
    def distributed(self) -> bool:
        return self.world_size > 1 or self.launcher != "none"


def _int_var(env: Mapping[str, str], name: str, launcher: str) -> int:
    text = env[name]
    try:
        return int(text)
    except ValueError:
        raise UserError(f"{launcher} launch: environment variable {name}={text!r} is not an integer") from None


def _require(env: Mapping[str, str], names: tuple[str, ...], launcher: str) -> None:
    missing = [n for n in names if n not in env]
    if missing:
        present = [n for n in names if n in env]
        raise UserError(f"{launcher} launch detected ({', '.join(present)} set) but {', '.join(missing)} "
                        f"{'is' if len(missing) == 1 else 'are'} missing; launch with {launcher} as documented "
                        f"in README.md or unset the partial variables")


def _check_rank(rank: int, world_size: int, local_rank: int, launcher: str) -> None:
    if world_size < 1 or not 0 <= rank < world_size or local_rank < 0:
        raise UserError(f"{launcher} launch: rank {rank}, world size {world_size}, local rank {local_rank} are "
                        f"contradictory (need 0 <= rank < world size)")


def from_torchrun(env: Mapping[str, str]) -> LaunchInfo | None:
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    if "RANK" not in env and "WORLD_SIZE" not in env:
        return None
    _require(env, names, "torchrun")
    rank = _int_var(env, "RANK", "torchrun")
    world = _int_var(env, "WORLD_SIZE", "torchrun")
    local = _int_var(env, "LOCAL_RANK", "torchrun")
    _check_rank(rank, world, local, "torchrun")
    local_world = _int_var(env, "LOCAL_WORLD_SIZE", "torchrun") if "LOCAL_WORLD_SIZE" in env else world
    return LaunchInfo("torchrun", rank, world, local, local_world, "env://")


def single_process(env: Mapping[str, str]) -> LaunchInfo:
    return LaunchInfo("none", 0, 1, 0, 1, "")


# Precedence order; launch sources for further launchers are inserted before single_process.
LAUNCH_SOURCES: list[Callable[[Mapping[str, str]], LaunchInfo | None]] = [from_torchrun]


def detect_launch(env: Mapping[str, str] | None = None) -> LaunchInfo:
    env = os.environ if env is None else env
    for source in LAUNCH_SOURCES:
        info = source(env)
        if info is not None:
            return info
    return single_process(env)
