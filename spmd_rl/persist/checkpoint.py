"""Checkpoints in `<run dir>/checkpoints/`: one file per rank, written so that a kill at any moment leaves the
previous checkpoint loadable, and read back with `torch.load(..., weights_only=True)` (no pickled code).

Layout:
    checkpoints/iter_000000123/rank0.pt ... rankN.pt   every rank's state at the end of iteration 123
    checkpoints/iter_000000123/COMPLETE                 written by rank 0 once every rank has saved
    checkpoints/latest                                  the name of the newest complete directory

A directory without COMPLETE is a save that was interrupted; it is never loaded and is removed at the next commit.
Each file is written under a temporary name, fsynced, renamed into place, and its directory fsynced (fileio), so a
file either has its final name and all its bytes, or does not exist; a full disk is a UserError naming the file.

States hold only what weights_only loading accepts: tensors, numbers, strings, None, lists, tuples and dicts.
capture_rng_state / restore_rng_state encode every random generator a rank draws from in those terms.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import torch

from spmd_rl.config.excerpts import excerpt
from spmd_rl.persist.fileio import checksum_matches, load_failure, make_dirs, torch_save_atomic, write_atomic
from spmd_rl.runtime.errors import UserError

CHECKPOINTS_DIR = "checkpoints"
LATEST = "latest"
COMPLETE = "COMPLETE"
_PREFIX = "iter_"


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
        """Write this rank's state for `iteration`; returns the file. Not loadable until commit(iteration)."""
        path = make_dirs(self.directory(iteration)) / _rank_file(rank)
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
            text = pointer.read_text().strip()
            named = self.root / text
            if named.parent == self.root and named.name.startswith(_PREFIX) and _is_complete(named):
                return named, ""
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

    def load(self, path: Path | str, rank: int, map_location: str | torch.device = "cpu") -> dict:
        """This rank's state from the checkpoint directory `path`. A missing, incomplete, truncated or corrupt
        checkpoint is a UserError naming the file and what to do."""
        return load_checkpoint(path, rank, map_location)

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


def load_checkpoint(path: Path | str, rank: int, map_location: str | torch.device = "cpu") -> dict:
    """Read rank `rank`'s state from a checkpoint directory (see CheckpointStore.load)."""
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
    expected = _marker(directory).get("files", {}).get(file.name)
    size = file.stat().st_size
    if expected is not None and size != expected:
        raise UserError(
            f"checkpoint file {file} is truncated or altered ({size} bytes, {expected} when saved): "
            f"delete {directory} to resume from the previous checkpoint"
        )
    if checksum_matches(file) is False:
        raise UserError(
            f"checkpoint file {file} is damaged (its contents differ from the checksum saved with them): "
            f"delete {directory} to resume from the previous checkpoint"
        )
    try:
        return torch.load(file, map_location=map_location, weights_only=True)
    except Exception as exc:  # torch raises several types for damaged files; each means the same to the user
        first_line = load_failure(exc)
        raise UserError(
            f"checkpoint file {file} cannot be read ({first_line}): delete {directory} to resume "
            f"from the previous checkpoint"
        ) from None


def capture_rng_state() -> dict:
    """Every process-global generator this rank draws from: python, numpy's global RNG, torch CPU and CUDA."""
    version, internal, gauss_next = random.getstate()
    _, key, pos, has_gauss, cached_gaussian = np.random.get_state()
    state = {
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
        return json.loads((directory / COMPLETE).read_text())
    except (OSError, ValueError):
        return {}


def _is_complete(directory: Path) -> bool:
    return "iteration" in _marker(directory)
