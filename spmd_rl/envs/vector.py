"""A rank's vector envs, through the backend env.backend names (envs/backend.py; the built-ins in envs/backends/):
probe the spaces up front, then make a rank's envs.

Vector envs run in gymnasium's default NEXT_STEP autoreset mode: the step that ends an episode returns the
episode's final observation, and the following step resets that env (its action is ignored). The env runner marks
such reset steps invalid, and GAE bootstraps truncated episodes from the final observation's value.
"""

from __future__ import annotations

import numpy as np

from spmd_rl.config.sections import EnvSection
from spmd_rl.envs.backend import EnvSpec, backend_for, differing_space
from spmd_rl.envs.success import resolve_success_key
from spmd_rl.envs.text import tokenized_spec
from spmd_rl.runtime.errors import UserError

__all__ = ["EnvSpec", "check_same_spaces", "group_of_envs", "make_vector_env", "probe_env"]


def probe_env(cfg: EnvSection) -> EnvSpec:
    """Make one env to learn its spaces; a missing id or a failing import is a UserError naming the env.
    With env.groups, one env of every group: their spaces must agree (the policy acts on all of them).
    Text observations are laid out as the token ids the env rank sends (envs/text.py); the success flag's key is
    resolved (envs/success.py)."""
    return resolve_success_key(tokenized_spec(backend_for(cfg).probe(cfg), cfg), cfg)


def check_same_spaces(spec: EnvSpec, other: EnvSpec, what: str) -> None:
    """`what` (e.g. eval.env) must give the spaces the policy was built for."""
    differing = differing_space(spec, other)
    if differing:
        name, mine, theirs = differing
        raise UserError(
            f"{what} gives another {name} than env: {theirs} vs {mine}; the policy acts on env's spaces, so change "
            f"{what} to keep them"
        )


def make_vector_env(cfg: EnvSection, spec: EnvSpec, seed: int, wrappers: list | None = None):
    """This rank's envs with episode statistics (and action clipping / reward scaling where asked).
    `wrappers` wrap each single env (evaluate's step limit and video recorder; not every backend takes them).
    With env.groups: every group's envs in the groups' order (group_of_envs says which env is whose).

    Returns the vector env and its first observation batch.
    """
    return backend_for(cfg).make(cfg, spec, seed, wrappers)


def group_of_envs(cfg: EnvSection) -> np.ndarray:
    """The group index of each of an env rank's envs (all 0 without env.groups): int64 [env.num_envs]."""
    if not cfg.groups:
        return np.zeros(cfg.num_envs, dtype=np.int64)
    return np.repeat(np.arange(len(cfg.groups)), [group.num_envs for group in cfg.groups])
