"""A policy whose construction hangs on rank 1 alone, after rank 1 took 3 s to import this module (within its
bound): rank 1's check starts after rank 0 already waits for the group, so rank 1's watchdog (dist.timeout_s from
its constructor's start) expires after rank 0's wait would without the meeting's margin.

    policy.class=tests.harness.rank_one_late_hang:HangsOnRankOne
"""

from __future__ import annotations

import time

from spmd_rl.modules.actor_critic import ActorCritic
from spmd_rl.runtime.launch import rank_from_env

if rank_from_env() == 1:
    time.sleep(3.0)


class HangsOnRankOne(ActorCritic):
    def __init__(self, *args, **kwargs):
        if rank_from_env() == 1:
            time.sleep(3600)
        super().__init__(*args, **kwargs)
