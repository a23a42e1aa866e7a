"""A policy module whose import hangs on rank 1 alone (fault pass 6, U3b): rank 1's watchdog ends it with its line
before the process group forms, while rank 0 waits for it in the ranks' meeting.

    policy.class=tests.harness.rank_one_import_hang:Policy
"""

from __future__ import annotations

import time

from spmd_rl.modules.actor_critic import ActorCritic as Policy
from spmd_rl.runtime.launch import rank_from_env

if rank_from_env() == 1:
    time.sleep(3600)

__all__ = ["Policy"]
