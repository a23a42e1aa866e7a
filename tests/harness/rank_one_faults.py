"""Policies whose construction fails on rank 1 alone, in the check before start (before the process group forms),
while rank 0's passes and goes on to wait for the group:

    policy.class=tests.harness.rank_one_faults:RaisesOnRankOne   # an exception: rank 1's user error
    policy.class=tests.harness.rank_one_faults:ExitsOnRankOne    # sys.exit(0): rank 1's error in user code
    policy.class=tests.harness.rank_one_faults:OsExitsOnRankOne  # os._exit(5): the same, without unwinding
    policy.class=tests.harness.rank_one_faults:KilledOnRankOne   # SIGKILL: rank 1 ends without a word
"""

from __future__ import annotations

import os
import signal
import sys

from spmd_rl.modules.actor_critic import ActorCritic
from spmd_rl.runtime.launch import rank_from_env


def _on_rank_one() -> bool:
    return rank_from_env() == 1  # torchrun's RANK, mpirun's OMPI_COMM_WORLD_RANK, srun's SLURM_PROCID


class RaisesOnRankOne(ActorCritic):
    def __init__(self, *args, **kwargs):
        if _on_rank_one():
            raise RuntimeError("this rank's own trouble (a file only rank 1 reads)")
        super().__init__(*args, **kwargs)


class ExitsOnRankOne(ActorCritic):
    def __init__(self, *args, **kwargs):
        if _on_rank_one():
            sys.exit(0)
        super().__init__(*args, **kwargs)


class OsExitsOnRankOne(ActorCritic):
    def __init__(self, *args, **kwargs):
        if _on_rank_one():
            os._exit(5)
        super().__init__(*args, **kwargs)


class KilledOnRankOne(ActorCritic):
    def __init__(self, *args, **kwargs):
        if _on_rank_one():
            os.kill(os.getpid(), signal.SIGKILL)
        super().__init__(*args, **kwargs)
