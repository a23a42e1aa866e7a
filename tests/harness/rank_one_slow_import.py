"""A plug-in module whose import on rank 1 alone never returns (it sleeps), for the checks before start of ranks
started by hand: rank 1 is still reading the config (importing this module) when rank 0 already waits for it.
When SPMD_RL_TEST_IMPORT_MARKER names a file, rank 1 creates it as the sleep begins (a test's moment to signal it).

    policy.class=tests.harness.rank_one_slow_import:ActorCritic
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from spmd_rl.modules.actor_critic import ActorCritic
from spmd_rl.runtime.launch import rank_from_env

__all__ = ["ActorCritic"]

if rank_from_env() == 1:
    if os.environ.get("SPMD_RL_TEST_IMPORT_MARKER"):
        Path(os.environ["SPMD_RL_TEST_IMPORT_MARKER"]).touch()
    time.sleep(3600)
