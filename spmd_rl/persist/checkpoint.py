"""Checkpoints in `<run dir>/checkpoints/`: one file per rank, written so that a kill at any moment leaves the
previous checkpoint loadable, and read back with `torch.load(..., weights_only=True)` (no pickled code).

Layout:
    checkpoints/iter_000000123/rank0.pt ... rankN.pt   every rank's state at the end of iteration 123
    checkpoints/iter_000000123/COMPLETE                 written by rank 0 once every rank has saved
    checkpoints/latest                                  the name of the newest complete directory

With sharded trainers (train.parallel=fsdp) the state's DTensors (parameter and optimizer shards) are written with
torch.distributed.checkpoint into `iter_<N>/shards/` by the trainers together, each its own part, and the rank file
keeps a placeholder per DTensor plus the SHA-256 of the shard files that rank wrote. Loading reads them back into
DTensors laid out over the loading run's trainers, however many: DCP reshards.

A directory without COMPLETE is a save that was interrupted; it is never loaded and is removed at the next commit.
Each file is written under a temporary name, fsynced, renamed into place, and its directory fsynced (fileio), so a
file either has its final name and all its bytes, or does not exist; a full disk is a UserError naming the file.

States hold only what weights_only loading accepts: tensors, numbers, strings, None, lists, tuples and dicts.
capture_rng_state / restore_rng_state encode every random generator a rank draws from in those terms.

A rank file is read through mmap, and only the tensors under a MAPPED_ROWS key stay backed by it: rows their
reader copies into buffers of its own at once (a memory replay's), which would otherwise be in memory twice while
a resume copies them. Every other tensor is copied into memory as it loads: a tensor kept as loaded (an
optimizer's moments: Optimizer.load_state_dict keeps same-dtype CPU tensors) would keep the whole file mapped,
and its disk space in use after the checkpoint is pruned, for the rest of the process.

Over 400 lines: writing, verifying and reading a checkpoint stay together, so what is written and what is
checked on reading cannot drift apart.
"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch

from spmd_rl.comm.sharding import is_dtensor, mesh_trainers
from spmd_rl.config.excerpts import excerpt
from spmd_rl.persist.fileio import (
    checksum_matches,
    file_error,
    load_failure,
    make_dirs,
    open_regular,
    sha256_of,
    torch_save_atomic,
    write_atomic,
)
from spmd_rl.persist.run_files import CHECKPOINT_PREFIX, CHECKPOINTS_DIR, COMPLETE_MARKER, SHARDS_DIR
from spmd_rl.runtime.errors import UserError

if TYPE_CHECKING:  # annotations only: torch.distributed.checkpoint is imported when a run shards
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

SHARDED = "__sharded__"  # a placeholder's key: {SHARDED: "<its key in the shard files>"}
SHARDS_FROM = "shards_from"  # added on loading: the checkpoint directory the placeholders' shard files are in
SHARD_FILES = "shard_files"  # rank file key: {file name: sha256} of the shard files this rank wrote
LATEST = "latest"
COMPLETE = COMPLETE_MARKER
_PREFIX = CHECKPOINT_PREFIX
# What is read of `latest` and of a COMPLETE marker at most: a name, and a file list with sizes. A pointer that is
# a FIFO waited for a writer forever and one linked to /dev/zero was read until memory ran out (fault pass 6, D4/D5).
_POINTER_BYTES = 4096
_MARKER_BYTES = 1 << 20


class CheckpointStore:
    """The checkpoints of one run directory. Every rank saves its own file; rank 0 commits."""

    def __init__(self, run_dir: Path | str, keep: int = 2):
        if keep < 1:
            raise UserError(f"checkpoint.keep={keep}: keep at least 1 checkpoint")
        self.root = Path(run_dir) / CHECKPOINTS_DIR
        self.keep = keep

    def directory(self, iteration: int) -> Path:
        return self.root / f"{_PREFIX}{iteration:09d}"

    def save(self, state: dict, iteration: int, rank: int) -> Path:
        """Write this rank's state for `iteration`; returns the file. Not loadable until commit(iteration).
        DTensors in the state go to the shard files, written by their trainers together (a collective)."""
        directory = make_dirs(self.directory(iteration))
        state, shards = split_sharded(state)
        if shards:
            state[SHARD_FILES] = save_shards(shards, directory / SHARDS_DIR)
        path = directory / _rank_file(rank)
        torch_save_atomic(state, path)
        return path

    def commit(self, iteration: int, world_size: int | None = None) -> Path:
        """Mark `iteration` complete, point `latest` at it, prune old checkpoints. Rank 0 calls this after every
        rank's save has returned (the caller's barrier). With world_size, first check that every rank's file is
        there. Returns the checkpoint directory."""
        directory = self.directory(iteration)
        files = sorted(p.name for p in directory.glob("rank*.pt"))
        if world_size is not None:
            missing = [_rank_file(r) for r in range(world_size) if _rank_file(r) not in files]
            if missing:
                raise RuntimeError(f"checkpoint {directory}: commit before every rank saved; missing {missing}")
        marker = {"iteration": iteration, "files": {name: (directory / name).stat().st_size for name in files}}
        write_atomic(directory / COMPLETE, json.dumps(marker) + "\n")
        write_atomic(self.root / LATEST, directory.name + "\n")  # its directory fsync also makes the new entry durable
        self._prune(iteration)
        return directory

    def latest(self) -> Path | None:
        """The newest complete checkpoint directory: the one `latest` names, or when that file is missing or names
        something that is not a complete checkpoint, the complete directory with the highest iteration."""
        return self.latest_and_why()[0]

    def latest_and_why(self) -> tuple[Path | None, str]:
        """latest(), and when `latest` could not be followed, a line saying what was found and what is done."""
        pointer = self.root / LATEST
        try:
            with open_regular(pointer) as file:  # a FIFO or a link to /dev/zero: never waited on or read on end
                text = file.read(_POINTER_BYTES).decode().strip()
            named = self.root / text
            if named.parent == self.root and named.name.startswith(_PREFIX) and _is_complete(named):
                newer = [d.name for _, d in self._complete() if d.name > named.name]
                if not newer:
                    return named, ""
                # an edited pointer, or a save that ended between its COMPLETE marker and the pointer's update
                return named, (
                    f"{pointer} names {named.name}, but {newer[-1]} is complete and newer: resuming from {named.name} "
                    f"as {LATEST} says (the iterations after it run again)"
                )
            found = f"{pointer} names {excerpt(text)}, which is not a complete checkpoint (damaged or deleted)"
        except FileNotFoundError:
            found = f"{pointer} is missing"
        except (OSError, UnicodeDecodeError, ValueError):
            found = f"{pointer} cannot be read"
        complete = self._complete()
        if complete:
            return complete[-1][1], f"{found}: resuming from {complete[-1][1]}, the newest complete checkpoint"
        if self.root.is_dir() and any(self.root.iterdir()):
            return None, f"{found}, and {self.root} holds no complete checkpoint"
        return None, ""

    def latest_sound_and_why(self) -> tuple[Path | None, str]:
        """latest_and_why(), stepping back past complete checkpoints with a damaged file (checkpoint_damage) to the
        newest sound one, each step said in the line; a UserError naming the damage when no earlier one is left."""
        checkpoint, why = self.latest_and_why()
        newest_damage = ""  # the first checkpoint passed over, when every one is damaged: restoring it loses least
        while checkpoint is not None:
            damage = checkpoint_damage(checkpoint)
            if not damage:
                return checkpoint, why
            older = [d for _, d in self._complete() if d.name < checkpoint.name]
            if not older and newest_damage:  # fault pass 8, D10: the line named only the oldest, "the only" one
                raise UserError(
                    f"every complete checkpoint of the run is damaged; the newest: {newest_damage}; the oldest: "
                    f"{damage}: restore the newest's file from a copy (it loses the least), or start a new run in "
                    f"another run.dir (run.init_from can take an earlier run's weights)"
                )
            if not older:
                raise UserError(f"{damage}: {what_to_do(checkpoint)}")
            newest_damage = newest_damage or damage
            note = f"{damage}: resuming from {older[-1]}, the newest complete checkpoint before it"
            why = f"{why}; {note}" if why else note
            checkpoint = older[-1]
        return None, why

    def load(self, path: Path | str, rank: int, map_location: str | torch.device = "cpu") -> dict:
        """This rank's state from the checkpoint directory `path`. A missing, incomplete, truncated or corrupt
        checkpoint is a UserError naming the file and what to do."""
        return load_checkpoint(path, rank, map_location)

    def pointer_blocked(self) -> str:
        """Why the next commit cannot write `latest` ('' when it can): a directory in its place, which a rename of a
        file never replaces, so a resume would train to its first checkpoint and fail there (fault pass 7, D5)."""
        pointer = self.root / LATEST
        if pointer.is_dir() and not pointer.is_symlink():  # a link to a directory is replaced like any link
            return (
                f"{pointer} is a directory, where every checkpoint writes the file naming the newest one (the run "
                f"would train and fail at its first checkpoint): move it away (or rm -r it) and rerun; this run "
                f"directory is left as it is"
            )
        return ""

    def damaged_markers(self) -> list[Path]:
        """Checkpoint directories whose COMPLETE marker is there but is not one a commit writes (it writes it whole,
        by rename): damage, not a save cut short, so their weights may be whole (fault pass 7, D6)."""
        return [d for _, d in sorted(self._directories()) if os.path.lexists(d / COMPLETE) and not _is_complete(d)]

    def _complete(self) -> list[tuple[int, Path]]:
        return sorted((it, d) for it, d in self._directories() if _is_complete(d))

    def _directories(self) -> list[tuple[int, Path]]:
        if not self.root.is_dir():
            return []
        found = []
        for d in self.root.iterdir():
            if d.is_dir() and d.name.startswith(_PREFIX) and d.name[len(_PREFIX) :].isdigit():
                found.append((int(d.name[len(_PREFIX) :]), d))
        return found

    def _prune(self, committed: int) -> None:
        # Checkpoints after the committed one belong to a history this run left by resuming from an earlier
        # checkpoint: they are the user's, and stay. Before it: keep the newest `keep` complete ones, and drop
        # interrupted saves.
        earlier = sorted(((it, d) for it, d in self._directories() if it <= committed), reverse=True)
        kept = 0
        for _, d in earlier:
            if _is_complete(d) and kept < self.keep:
                kept += 1
                continue
            shutil.rmtree(d, ignore_errors=True)


def find_checkpoint(path: Path | str) -> Path:
    """The checkpoint directory a user means by `path`: a checkpoint directory itself, or the latest complete one
    in a run directory or its checkpoints/ directory."""
    path = Path(path)
    if (path / COMPLETE).exists():
        return path
    for run_dir in (path, path.parent if path.name == CHECKPOINTS_DIR else None):
        if run_dir is not None and (run_dir / CHECKPOINTS_DIR).is_dir():
            found = CheckpointStore(run_dir).latest()
            if found is not None:
                return found
            raise UserError(f"{run_dir / CHECKPOINTS_DIR} holds no complete checkpoint")
    if path.name.startswith(_PREFIX) and path.is_dir():
        raise UserError(
            f"checkpoint {path} is incomplete (no {COMPLETE} marker: its save was interrupted); "
            f"resume from an earlier checkpoint in {path.parent}"
        )
    raise UserError(f"{path} is not a checkpoint: give a run directory or <run dir>/{CHECKPOINTS_DIR}/{_PREFIX}<N>")


MAPPED_ROWS = "mapped_rows"  # a state's tensors under this key are read from the checkpoint file as they are used


def _copied_off_the_file(value, mapped: bool = False):
    """The loaded state with every tensor outside a MAPPED_ROWS entry copied into memory."""
    if isinstance(value, torch.Tensor):
        return value if mapped else value.clone()
    if isinstance(value, dict):
        return {k: _copied_off_the_file(v, mapped or k == MAPPED_ROWS) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_copied_off_the_file(v, mapped) for v in value)
    return value


def load_checkpoint(path: Path | str, rank: int, map_location: str | torch.device = "cpu", whole: bool = False) -> dict:
    """Read rank `rank`'s state from a checkpoint directory (see CheckpointStore.load). whole: a sharded
    checkpoint's placeholders are read as whole tensors here (for evaluation and run.init_from)."""
    directory = Path(path)
    if not directory.is_dir():
        raise UserError(
            f"checkpoint {directory} does not exist: give a directory like "
            f"<run dir>/{CHECKPOINTS_DIR}/{_PREFIX}000000100"
        )
    if not _is_complete(directory):
        raise UserError(
            f"checkpoint {directory} is incomplete (no {COMPLETE} marker: its save was interrupted); "
            f"resume from an earlier checkpoint in {directory.parent}"
        )
    file = directory / _rank_file(rank)
    if not file.is_file():
        held = sorted(p.name for p in directory.glob("rank*.pt"))
        raise UserError(
            f"checkpoint {directory} has no {file.name} (it holds {', '.join(held) or 'no rank files'}): "
            f"resume with the number of ranks that wrote it"
        )
    damage = rank_file_damage(file)
    if damage:
        raise UserError(f"{damage}: {what_to_do(directory, resuming=not whole)}")
    try:
        state = _copied_off_the_file(torch.load(file, map_location=map_location, weights_only=True, mmap=True))
    except Exception as exc:  # torch raises several types for damaged files; each means the same to the user
        raise UserError(
            f"checkpoint file {file} cannot be read ({load_failure(exc)}): {what_to_do(directory, resuming=not whole)}"
        ) from None
    if has_shards(state):
        state[SHARDS_FROM] = str(directory)  # where its placeholders' DTensors are (load_shards)
        if whole:
            verify_shard_files(state, resuming=False)
            # Read whole, the policy comes from every trainer's shard files, and this rank's file lists only its own.
            damage = other_ranks_shard_damage(directory, file)
            if damage:
                raise UserError(f"{damage}: {what_to_do(directory, resuming=False)}")
            return load_shards(state, directory)
    return state


def rank_file_damage(file: Path) -> str:
    """What is wrong with a committed checkpoint's rank file ('' when its size is the one its COMPLETE marker
    recorded and its contents match their checksum)."""
    expected = _marker(file.parent).get("files", {}).get(file.name)
    size = file.stat().st_size
    if expected is not None and size != expected:
        return f"checkpoint file {file} is truncated or altered ({size} bytes, {expected} when saved)"
    if checksum_matches(file) is False:
        return f"checkpoint file {file} is damaged (its contents differ from the checksum saved with them)"
    return ""


def shard_file_damage(state: dict) -> str:
    """What is wrong with the shard files a loaded rank state wrote ('' when each matches the SHA-256 saved with
    it, or the state has none)."""
    if not has_shards(state):
        return ""
    shards_dir = Path(state[SHARDS_FROM]) / SHARDS_DIR
    for name, digest in state[SHARD_FILES].items():
        if not (shards_dir / name).is_file():
            return f"checkpoint shard file {shards_dir / name} is missing"
        if sha256_of(shards_dir / name) != digest:
            return (
                f"checkpoint shard file {shards_dir / name} is damaged (its contents differ from the checksum saved "
                f"with them)"
            )
    return ""


def other_ranks_shard_damage(directory: Path, file: Path) -> str:
    """The first damaged shard file that another rank of a checkpoint wrote ('' when none is): a checkpoint read
    whole reads every trainer's shards, and each rank file holds the checksums of its own alone. A rank file that
    cannot be read is passed over here (its shards cannot be checked without it; reading it for itself says why)."""
    for other in sorted(directory.glob("rank*.pt")):
        if other == file or rank_file_damage(other):
            continue
        try:
            state = torch.load(other, map_location="cpu", weights_only=True, mmap=True)
        except Exception:  # noqa: BLE001 - torch raises several types for damaged files
            continue
        if isinstance(state, dict) and has_shards(state):
            damage = shard_file_damage({**state, SHARDS_FROM: str(directory)})
            if damage:
                return damage
    return ""


def verify_shard_files(state: dict, resuming: bool = True) -> None:
    """A UserError naming the first damaged shard file of a loaded rank state, and what to do."""
    damage = shard_file_damage(state)
    if damage:
        raise UserError(f"{damage}: {what_to_do(Path(state[SHARDS_FROM]), resuming)}")


def checkpoint_damage(directory: Path) -> str:
    """What is wrong with a complete checkpoint: its first damaged rank file or shard file ('' when it is sound).
    Reads every file of it (rank 0 before it resumes, so that a damaged newest checkpoint falls back to an older
    one rather than failing on the rank that reads the damage)."""
    marked = _marker(directory).get("iteration")
    named = directory.name[len(_PREFIX) :]
    if directory.name.startswith(_PREFIX) and named.isdigit() and marked is not None and marked != int(named):
        # a marker copied from another checkpoint: its recorded sizes would blame this one's sound files
        return (
            f"checkpoint marker {directory / COMPLETE} is of iteration {marked}, not of {directory.name} (copied "
            f"from another checkpoint?)"
        )
    for file in sorted(directory.glob("rank*.pt")):
        damage = rank_file_damage(file)
        if damage:
            return damage
        try:
            state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except Exception as exc:  # noqa: BLE001 - torch raises several types for damaged files
            return f"checkpoint file {file} cannot be read ({load_failure(exc)})"
        held = state.get("iteration") if isinstance(state, dict) else None
        if isinstance(held, int) and marked is not None and held != marked:
            # a whole rank file of another checkpoint, of the same size (fault pass 9, D2: the inference rank's file
            # of iteration 3 in iteration 5 resumed without a word; D1: a trainer's was blamed on its shard file)
            return (
                f"checkpoint file {file} holds the state of iteration {held}, not of iteration {marked} (copied from "
                f"another checkpoint?)"
            )
        if isinstance(state, dict) and has_shards(state):
            damage = shard_file_damage({**state, SHARDS_FROM: str(directory)})
            if damage:
                return damage
    return ""


def what_to_do(directory: Path, resuming: bool = True) -> str:
    """The advice after a damaged checkpoint. Resuming: from an earlier complete one where there is one; there is
    none with checkpoint.keep: 1 (deleting the only checkpoint would start the run over and clear its metrics).
    Reading it (evaluation, run.init_from): the earlier one by name, or a copy of the file."""
    siblings = directory.parent.iterdir() if directory.parent.is_dir() else iter(())
    earlier = sorted(d for d in siblings if d.name.startswith(_PREFIX) and d.name < directory.name and _is_complete(d))
    if not resuming:
        instead = f"give the previous checkpoint, {earlier[-1]}, instead, or " if earlier else ""
        return f"{instead}restore the file from a copy"
    if earlier:
        return f"delete {directory} to resume from the previous checkpoint ({earlier[-1].name})"
    return (
        "it is the run's only complete checkpoint: restore the file from a copy, or start a new run in another "
        "run.dir (run.init_from can take an earlier run's weights)"
    )


def split_sharded(state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(state with a placeholder for every DTensor, {key: DTensor}); keys are the DTensors' paths in state."""
    shards: dict[str, Any] = {}

    def walk(value, path: str):
        if is_dtensor(value):
            shards[path] = value.detach()
            return {SHARDED: path}
        if isinstance(value, dict):
            return {k: walk(v, f"{path}.{k}" if path else str(k)) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(walk(v, f"{path}.{i}") for i, v in enumerate(value))
        return value

    return walk(state, ""), shards


def save_shards(shards: dict, directory: Path) -> dict[str, str]:
    """Write the DTensors with torch.distributed.checkpoint (every trainer of their mesh takes part, each writing
    its own shards); returns {file: sha256} of the files this rank wrote (the first trainer also hashes the
    metadata)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    group = mesh_trainers(next(iter(shards.values())).device_mesh)
    try:
        with warnings.catch_warnings():
            # Shards already here are a save of this iteration that never became loadable (interrupted) or that a
            # resume fell back from (damaged): this save writes every shard file and the metadata anew, and the
            # checkpoint is loadable only once commit writes its COMPLETE marker after it. So torch's "existing
            # checkpoint ... overwriting" warning (once per trainer) says nothing to act on.
            warnings.filterwarnings("ignore", message="Detected an existing checkpoint in", category=UserWarning)
            writer = dcp.FileSystemWriter(directory, sync_files=True, overwrite=True)  # newer torch defaults False
            dcp.save(shards, storage_writer=writer, process_group=group)
    except (Exception, dcp.CheckpointException) as exc:  # noqa: BLE001 - DCP gathers every rank's failure into
        # its CheckpointException, a BaseException: `except Exception` let it through as a 160-line traceback on
        # every trainer and exit 1 when the disk filled during a sharded save (fault pass 5, W1)
        cause: BaseException = exc
        if isinstance(exc, dcp.CheckpointException) and exc.failures:  # {rank: (the exception, its frames)}
            cause = next(iter(exc.failures.values()))[0]
        if isinstance(cause, OSError):
            raise file_error(directory, cause) from None
        if _no_space_left(directory):  # torch's zip writer words a short write as "unexpected pos 704 vs 598"
            raise file_error(directory, OSError(errno.ENOSPC, "disk full")) from None
        raise UserError(f"writing the sharded checkpoint {directory} failed: {_first_line(cause)}") from None
    mine = f"__{dist.get_rank(group)}_"
    names = [p.name for p in directory.iterdir() if p.name.startswith(mine) or p.name == ".metadata"]
    if dist.get_rank(group) != 0:
        names = [n for n in names if n != ".metadata"]
    return {name: sha256_of(directory / name) for name in sorted(names)}


def load_shards(state: dict, directory: Path, like=None) -> dict:
    """state with its placeholders replaced by DTensors read from the shard files, laid out like the DTensor
    `like` (the loading run's mesh and placements; every trainer of that mesh calls it together), or with like
    None by whole tensors in this process alone (evaluation, run.init_from), read without a process group.
    The shard files' checksums are the caller's to check first (verify_shard_files): before the collective, so
    that a refusal can be agreed."""
    import torch.distributed.checkpoint as dcp

    shards_dir = directory / SHARDS_DIR
    reader = dcp.FileSystemReader(shards_dir)
    try:
        stored = reader.read_metadata().state_dict_metadata
    except Exception as exc:  # noqa: BLE001 - a missing or unreadable .metadata
        raise UserError(
            f"checkpoint {directory}: its shard files cannot be read ({_first_line(exc)}): "
            f"{what_to_do(directory, resuming=like is not None)}"
        ) from None
    targets = {}
    for key in placeholder_keys(state):
        meta = stored.get(key)
        if meta is None:
            raise UserError(f"checkpoint {directory}: its shard files hold no '{key}'; resume with the same config")
        tensor_meta = cast("TensorStorageMetadata", meta)  # placeholder keys are tensors
        targets[key] = _empty_like_stored(tuple(tensor_meta.size), tensor_meta.properties.dtype, like)
    if like is None:
        with warnings.catch_warnings():  # DCP warns that it reads in one process: what is asked of it here
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            try:
                dcp.load(targets, storage_reader=reader, no_dist=True)
            except (Exception, dcp.CheckpointException) as exc:  # noqa: BLE001 - a shard file missing or unreadable
                # (the caller checked only the files of the rank file it read: a whole read needs every trainer's);
                # DCP raises its CheckpointException, a BaseException, around the cause
                cause: BaseException = exc
                if isinstance(exc, dcp.CheckpointException):  # {rank: (the exception, its frames)}
                    cause = next(iter(exc.failures.values()))[0]
                raise UserError(
                    f"checkpoint {directory}: its shard files cannot be read ({_first_line(cause)}): "
                    f"{what_to_do(directory, resuming=False)}"
                ) from None
    else:
        dcp.load(targets, storage_reader=reader, process_group=mesh_trainers(like.device_mesh))

    def fill(value):
        if isinstance(value, dict):
            if set(value) == {SHARDED}:
                return targets[value[SHARDED]]
            return {k: fill(v) for k, v in value.items() if k not in (SHARD_FILES, SHARDS_FROM)}
        if isinstance(value, (list, tuple)):
            return type(value)(fill(v) for v in value)
        return value

    return fill(state)


def stored_shapes(tensors: dict[str, Any], directory: Path | None) -> dict[str, tuple[int, ...]]:
    """The shapes a checkpoint holds for a dict of tensors and sharded placeholders (read from the shard files'
    metadata in directory, without reading the shards)."""
    shapes = {key: tuple(value.shape) for key, value in tensors.items() if isinstance(value, torch.Tensor)}
    placeholders = {key: value[SHARDED] for key, value in tensors.items() if isinstance(value, dict)}
    if placeholders and directory is not None:
        import torch.distributed.checkpoint as dcp

        try:
            stored = dcp.FileSystemReader(directory / SHARDS_DIR).read_metadata().state_dict_metadata
        except Exception as exc:  # noqa: BLE001 - a missing or unreadable .metadata
            raise UserError(
                f"checkpoint {directory}: its shard files cannot be read ({_first_line(exc)}): {what_to_do(directory)}"
            ) from None
        for key, path in placeholders.items():
            meta = stored.get(path)
            if meta is not None:
                shapes[key] = tuple(cast("TensorStorageMetadata", meta).size)
    return shapes


def placeholder_keys(state) -> list[str]:
    """The keys of a state's sharded placeholders, in order."""
    keys: list[str] = []

    def walk(value):
        if isinstance(value, dict):
            if set(value) == {SHARDED}:
                keys.append(value[SHARDED])
                return
            for v in value.values():
                walk(v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                walk(v)

    walk(state)
    return keys


def has_shards(state: dict) -> bool:
    return SHARD_FILES in state


def _empty_like_stored(shape: tuple, dtype: torch.dtype, like):
    """An uninitialized tensor to read a stored one into: a DTensor laid out like `like`, or a plain tensor."""
    if like is None:
        return torch.empty(shape, dtype=dtype)
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor import empty as empty_dtensor

    placements = like.placements if shape else [Replicate()] * len(like.placements)  # a 0-d one is replicated
    return empty_dtensor(shape, dtype=dtype, device_mesh=like.device_mesh, placements=placements)


def _no_space_left(directory: Path) -> bool:
    try:
        return os.statvfs(directory).f_bavail == 0
    except OSError:
        return False


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def capture_rng_state() -> dict:
    """Every process-global generator this rank draws from: python, numpy's global RNG, torch CPU and CUDA."""
    version, internal, gauss_next = random.getstate()
    # The legacy form (get_state's default) is a tuple; numpy types it as a tuple or a dict.
    _, key, pos, has_gauss, cached_gaussian = cast(tuple[str, np.ndarray, int, int, float], np.random.get_state())
    state: dict[str, Any] = {
        "python": {"version": version, "internal": list(internal), "gauss_next": gauss_next},
        "numpy": {
            "key": torch.from_numpy(key.copy()),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict) -> None:
    """Undo capture_rng_state: the next draws repeat those that followed the capture."""
    python = state["python"]
    random.setstate((python["version"], tuple(python["internal"]), python["gauss_next"]))
    numpy = state["numpy"]
    np.random.set_state(("MT19937", numpy["key"].numpy(), numpy["pos"], numpy["has_gauss"], numpy["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        for device, cuda_state in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(cuda_state, device)


def _rank_file(rank: int) -> str:
    return f"rank{rank}.pt"


def _marker(directory: Path) -> dict:
    try:
        with open_regular(directory / COMPLETE) as file:  # as `latest`: a FIFO or a device is no marker
            return json.loads(file.read(_MARKER_BYTES))
    except (OSError, ValueError):
        return {}


def _is_complete(directory: Path) -> bool:
    return "iteration" in _marker(directory)
