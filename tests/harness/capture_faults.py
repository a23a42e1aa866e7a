"""A PPO whose state_dict raises a UserError on rank 0 alone, at the first checkpoint: what a sharded trainer's
capture of its state hit when a file it read then (a pretrained folder, re-read for policy.pt's copy) had changed
(fault pass 6, V5). Its peer trainer has captured its state and entered the sharded save, a collective.

    algo.class=tests.harness.capture_faults:CaptureFailsOnRankZero
"""

from __future__ import annotations

from spmd_rl.algorithms.ppo import PPO
from spmd_rl.runtime.errors import UserError
from spmd_rl.runtime.launch import rank_from_env


class CaptureFailsOnRankZero(PPO):
    def state_dict(self):
        if rank_from_env() == 0:
            raise UserError("rank 0's own trouble while capturing its state (a file it reads then changed)")
        return super().state_dict()
