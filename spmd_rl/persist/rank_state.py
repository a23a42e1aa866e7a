"""What one rank's checkpoint holds, and the one pair of functions that saves and restores it: every component the
rank runs (its role components and any of an engine's own) under its name, its `state_dict()` there, plus the
iteration and the rank's random generators. This module is the one home of those names.

    {"trainer": {...}, "report": {...}, "env_runner": {...}, "inference_server": {...}, "<an engine's own>": {...},
     "iteration": 123, "rng": {...}}

A component is anything with `state_dict() -> dict` and `load_state_dict(state)`; a rank holds the components of
its role (a colocated rank all four). Checkpoints written before components had names kept their keys side by side
at the top level: `in_component_layout` regroups them on loading, so they resume and are read like new ones.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from spmd_rl.persist.checkpoint import (
    SHARD_FILES,
    SHARDS_FROM,
    load_checkpoint,
    placeholder_keys,
    restore_rng_state,
    verify_shard_files,
)
from spmd_rl.runtime.errors import UserError

# The role components' names.
TRAINER, REPORT, ENV_RUNNER, INFERENCE_SERVER = "trainer", "report", "env_runner", "inference_server"
ITERATION, RNG = "iteration", "rng"  # the run's own entries, added by the end-of-iteration agreement
POLICY, ALGORITHM = "policy", "algorithm"  # in a trainer's part: what run.init_from and evaluation read
# What an engine's override of SyncEngine.checkpoint_state returns (that hook is deprecated, kept for one release).
CHECKPOINT_STATE_HOOK = "checkpoint_state"
# What a resharded resume takes from trainer 0's file (run.resume onto another number of ranks, fsdp only).
RESHARDED = (TRAINER, REPORT, SHARD_FILES, SHARDS_FROM)

# The flat layout of earlier checkpoints: each top-level key, the component it belonged to, and its key there
# (None: the component's whole state).
FLAT_LAYOUT = {
    POLICY: (TRAINER, POLICY),
    ALGORITHM: (TRAINER, ALGORITHM),
    "experience_rows": (TRAINER, "experience_rows"),
    "metrics": (REPORT, None),
    "env": (ENV_RUNNER, "env"),
    "worker": (ENV_RUNNER, "worker"),
    "recurrent_state": (INFERENCE_SERVER, "recurrent_state"),
}
RESERVED = (
    TRAINER,
    REPORT,
    ENV_RUNNER,
    INFERENCE_SERVER,
    ITERATION,
    RNG,
    SHARD_FILES,
    SHARDS_FROM,
    CHECKPOINT_STATE_HOOK,
    *FLAT_LAYOUT,
)


class Component(Protocol):
    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


def check_names(components: Mapping[str, Any], owner: str) -> None:
    """An engine's own components: names of their own, never one the run's state uses."""
    taken = [name for name in components if name in RESERVED or not isinstance(name, str) or not name]
    if taken:
        raise UserError(
            f"{owner} names component(s) {taken}: a checkpoint keeps {', '.join(RESERVED)} for the run's own "
            f"state; give each of your components another name"
        )


def capture(components: Mapping[str, Component]) -> dict:
    """This rank's part of a checkpoint: each component's state under its name (the agreement adds the iteration
    and the generators)."""
    return {name: component.state_dict() for name, component in components.items()}


def check(components: Mapping[str, Component], state: dict | None) -> None:
    """What a rank checks alone before restore loads `state` (any part of it may be a collective: the sharded
    load): its shard files' checksums, and each component's own check of its part (`check_state_dict`, where a
    component has one: the trainer's of its policy's shapes). A UserError naming what does not fit."""
    if state is None:
        return
    verify_shard_files(state)
    shards = {key: state[key] for key in (SHARD_FILES, SHARDS_FROM) if key in state}
    for name, component in components.items():
        checker = getattr(component, "check_state_dict", None)
        if checker is not None and name in state:
            checker({**state[name], **shards})


def restore(components: Mapping[str, Component], state: dict | None, generators: bool = True) -> None:
    """Load what capture() saved into the components (one that the checkpoint holds nothing for stays as built),
    then, with generators, the rank's random generators: last, because building the components drew from them.
    A part with sharded placeholders gets the shard files' location with it (train.parallel=fsdp)."""
    if state is None:
        return
    shards = {key: state[key] for key in (SHARD_FILES, SHARDS_FROM) if key in state}
    for name, component in components.items():
        if name in state:
            part = state[name]
            component.load_state_dict({**part, **shards} if shards and placeholder_keys(part) else part)
    if generators:
        restore_rng_state(state[RNG])


def load_state(directory, rank: int, whole: bool = False) -> dict:
    """Rank `rank`'s state from a checkpoint directory (persist.checkpoint.load_checkpoint, on the CPU), in the
    layout of named components."""
    return in_component_layout(load_checkpoint(directory, rank, "cpu", whole))


def in_component_layout(state: dict) -> dict:
    """A loaded rank state in the layout of named components, whichever layout it was written in."""
    if not any(key in state for key in FLAT_LAYOUT):
        return state
    regrouped: dict = {}
    for key, value in state.items():
        if key not in FLAT_LAYOUT:
            regrouped[key] = value
            continue
        name, inner = FLAT_LAYOUT[key]
        if inner is None:
            regrouped[name] = value
        else:
            regrouped.setdefault(name, {})[inner] = value
    return regrouped
