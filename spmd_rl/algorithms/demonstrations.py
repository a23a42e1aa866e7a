"""Demonstrations for supervised learning (`algo.class: bc`): experience files (schema.py's layout, as the
experience log and `python -m spmd_rl.collect` write them) named by a file, a folder or a glob, checked against the
env's layout as the policy sees it, and read as decisions, each trainer its own share of the episodes.

A row of an experience file is one decision of one env (rows of a rollout [T, N] are time-major); what bc learns
from is a row's obs and action. Rows that are no demonstrated decision are left out: a reset step (`valid` false,
also set for the steps of an env whose episode ended in a rollout of whole episodes). With action chunks a row's
action is the chunk [K, ...], and its `chunk_valid` [K] (read too where the file has it) says which of its actions
ran: an episode's end cuts a chunk short, and what a file holds past it is no demonstration (python -m spmd_rl.collect
writes zeros there; the experience log the actions the policy drew but never ran), so bc learns the valid ones only.
"""

from __future__ import annotations

import glob
from dataclasses import dataclass
from pathlib import Path

import gymnasium as gym
import numpy as np
import torch
from tensordict import TensorDict

from spmd_rl.config.excerpts import clip
from spmd_rl.envs.spaces import zeros_of
from spmd_rl.interfaces.policy import CHUNK_VALID
from spmd_rl.runtime.errors import UserError
from spmd_rl.storage.h5file import DAMAGED_FILE_ERRORS, damaged
from spmd_rl.storage.reader import HDF5Reader
from spmd_rl.storage.schema import Field, describe_field, layout_of

# The step fields a demonstration file must hold besides obs and action (the experience log's ENV_FIELDS); with
# action chunks it has chunk_valid too.
STEP_FIELDS = ("valid", "terminated", "truncated")
READ_ROWS = 1 << 16  # rows read at a time, so a trainer holds only its own share of a large file


def demonstration_files(demos: str, key: str = "algo.demos") -> list[Path]:
    """The HDF5 files `demos` names: a file; a folder's *.h5 (else its buffer/*.h5: a run directory's experience
    log); or the files a glob matches. None found is a UserError naming the key."""
    if not demos:
        raise UserError(f"{key} is not set: give the demonstrations, an HDF5 file, a folder of them or a glob")
    path = Path(demos).expanduser()
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(path.glob("*.h5")) or sorted((path / "buffer").glob("*.h5"))
        if not files:
            raise UserError(f"{key}={clip(demos)}: the folder holds no .h5 files (nor buffer/*.h5)")
        return files
    files = sorted(Path(match) for match in glob.glob(str(path)) if Path(match).is_file())
    if not files:
        raise UserError(f"{key}={clip(demos)}: no such file or folder, and no file matches it as a glob")
    return files


def expected_layout(observation_space: gym.Space, action_space: gym.Space) -> dict[str, Field]:
    """The obs/* and action keys of a demonstration file of this env, as the policy sees it (token ids for text,
    the chunk Box [K, *shape] with action chunks)."""
    example = TensorDict({"obs": zeros_of(observation_space, 1), "action": zeros_of(action_space, 1)}, batch_size=[1])
    return layout_of(example)


def check_layout(path: Path, layout: dict[str, Field], expected: dict[str, Field]) -> None:
    """A file of another observation or action layout than the env's is a UserError naming the file and the first
    key that differs. The action's dtype may differ (it is converted); its shape may not."""
    obs_keys = {key for key in layout if key == "obs" or key.startswith("obs/")}
    for key in sorted(obs_keys | set(expected)):
        if key not in layout:
            raise UserError(
                f"{path}: no key {key!r}, which this env's demonstrations have ({describe_field(expected[key])}): "
                f"the file holds demonstrations of another env or observation layout"
            )
        if key not in expected:
            raise UserError(
                f"{path}: key {key!r} ({describe_field(layout[key])}) is no part of this env's observations: the "
                f"file holds demonstrations of another env or observation layout"
            )
        same = layout[key][0] == expected[key][0] if key == "action" else layout[key] == expected[key]
        if not same:
            raise UserError(
                f"{path}: key {key!r} is {describe_field(layout[key])}, and this env's is "
                f"{describe_field(expected[key])}: the file holds demonstrations of another env or layout"
                f"{' (env.action_chunk?)' if key == 'action' else ''}"
            )
    for key in STEP_FIELDS:
        if key not in layout:
            raise UserError(
                f"{path}: no key {key!r}: not an experience file of demonstrations (spmd_rl's experience log and "
                f"python -m spmd_rl.collect write it)"
            )


def check_files(files: list[Path], expected: dict[str, Field]) -> None:
    """Every file opens as an experience file, holds rows and has the env's layout (exit 2 naming file and key)."""
    for path in files:
        with HDF5Reader(path) as reader:
            check_layout(path, reader.layout, expected)
            if len(reader) == 0:
                raise UserError(f"{path}: the file holds no rows (no demonstrations)")


@dataclass
class Share:
    """A trainer's share of the demonstrations: its decisions (obs and action, [M]) and the counts over all files."""

    decisions: TensorDict  # with chunk_valid [M, K] where a file has it (rows of a file without it: all true)
    episodes: int  # episodes in all files
    cut_chunks: int  # decisions of all files whose chunk an episode's end cut short (learned from its valid steps)


def read_share(files: list[Path], expected: dict[str, Field], trainer_index: int, num_trainers: int) -> Share:
    """The decisions of every num_trainers-th episode from the trainer_index-th on (episodes numbered over the files
    in order, each file's by env column and order of ending), with their obs and action, and chunk_valid where any
    file holds it."""
    episodes = cut = 0
    parts: list[dict[str, np.ndarray]] = []
    for path in files:
        try:
            with HDF5Reader(path) as reader:
                keep = reader.column("data/valid").astype(bool)
                # Numbered over the episodes with a decision (not the reset step after a column's last end).
                numbers, in_file = np.unique(_episode_numbers(reader)[keep], return_inverse=True)
                episode = np.full(len(keep), -1, dtype=np.int64)
                episode[keep] = in_file.reshape(-1) + episodes
                episodes += len(numbers)
                if CHUNK_VALID in reader.layout:
                    whole = reader.column(f"data/{CHUNK_VALID}").reshape(len(reader), -1).all(1)
                    cut += int((keep & ~whole).sum())
                keep &= episode % num_trainers == trainer_index
                keys = [*expected, CHUNK_VALID] if CHUNK_VALID in reader.layout else expected
                parts.append({key: _selected(reader, f"data/{key}", keep) for key in keys})
        except DAMAGED_FILE_ERRORS as exc:
            raise damaged(path, exc) from None
    if any(CHUNK_VALID in part for part in parts):
        for part in parts:  # a file without it ran its chunks whole
            part.setdefault(CHUNK_VALID, np.ones(part["action"].shape[:2], dtype=bool))
    arrays = {key: np.concatenate([part[key] for part in parts]) for key in parts[0]}
    rows = len(arrays["action"])
    decisions = TensorDict(
        {tuple(key.split("/")): torch.from_numpy(array) for key, array in arrays.items()}, batch_size=[rows]
    )
    return Share(decisions, episodes, cut)


def _episode_numbers(reader: HDF5Reader) -> np.ndarray:
    """Each row's episode within the file, as (env column, episodes that ended in that column before the row) in
    one number that sorts alike: a row after an episode's end starts the column's next one."""
    env_id = reader.column("meta/env_id")
    ended = reader.column("data/terminated").astype(bool) | reader.column("data/truncated").astype(bool)
    before = np.zeros(len(env_id), dtype=np.int64)
    for column in np.unique(env_id):
        rows = np.flatnonzero(env_id == column)
        ends = ended[rows].astype(np.int64)
        before[rows] = np.cumsum(ends) - ends
    return env_id * (len(env_id) + 1) + before


def _selected(reader: HDF5Reader, name: str, keep: np.ndarray) -> np.ndarray:
    """The rows of one dataset where keep is true, read READ_ROWS at a time."""
    blocks = [
        reader.column(name, start, start + READ_ROWS)[keep[start : start + READ_ROWS]]
        for start in range(0, len(keep), READ_ROWS)
    ]
    return np.concatenate(blocks) if blocks else reader.column(name, 0, 0)
