"""Success, measured per episode: the flag an env reports in its step info under env.success_key (`success` by
default), as robot-manipulation envs do. An episode succeeded if the flag was set at any of its steps
(`success_rate`), and succeeded at its end if it was set at its last step (`success_at_end_rate`). With action
chunks a decision runs several steps: any of them sets "at any step" (the chunk wrapper's CHUNK_SUCCESS), the last
one "at its end".

Whether an env reports the key is learned before any process group forms, from the keys of one step's info that
its backend's probe saw (EnvSpec.step_info_keys): segments carry the success fields only for such envs, so
classic envs keep their layout and metrics. A key the user named that the info lacks is a UserError.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from spmd_rl.config.excerpts import clip
from spmd_rl.config.sections import EnvSection
from spmd_rl.envs.chunks import CHUNK_SUCCESS
from spmd_rl.runtime.errors import UserError

DEFAULT_SUCCESS_KEY = "success"


def resolve_success_key(spec, cfg: EnvSection):
    """The EnvSpec with success_key set where the env's step info has env.success_key (or, unset, `success`)."""
    key = cfg.success_key or DEFAULT_SUCCESS_KEY
    if key in spec.step_info_keys:
        return dataclasses.replace(spec, success_key=key)
    if cfg.success_key:
        seen = ", ".join(sorted(spec.step_info_keys)[:20]) or "none"
        raise UserError(
            f"env.success_key={clip(cfg.success_key)}: env '{clip(cfg.id)}' has no such key in its step info (a "
            f"probing step gave: {clip(seen)}); set env.success_key to the key of its success flag, or remove it"
        )
    return spec


def info_flags(info: dict, key: str, num_envs: int) -> np.ndarray:
    """The key's flag per env in a vector env's info (False where an env did not report it this step)."""
    if key not in info:
        return np.zeros(num_envs, dtype=bool)
    flags = np.asarray(info[key]).astype(bool)
    reported = info.get(f"_{key}")
    return flags & reported if reported is not None else flags


class EpisodeSuccess:
    """Each env's success so far in its episode; `step` says, for the episodes that just ended, whether they
    succeeded at any step and at their last one."""

    def __init__(self, key: str, num_envs: int):
        self.key = key
        self.seen = np.zeros(num_envs, dtype=bool)

    def step(self, info: dict, valid: np.ndarray, done: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(success at any step, success at the last step), each [num_envs], True only where an episode ended
        with this step. `valid`: the step was a real transition (not NEXT_STEP autoreset's reset step)."""
        flags = info_flags(info, self.key, len(self.seen)) & valid
        self.seen |= info_flags(info, CHUNK_SUCCESS, len(self.seen)) & valid if CHUNK_SUCCESS in info else flags
        at_any, at_end = self.seen & done, flags & done
        self.seen[done] = False
        return at_any, at_end
