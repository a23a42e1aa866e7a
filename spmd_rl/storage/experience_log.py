"""The experience log: every transition a rank's trainer consumes, in one HDF5 file per rank (see writer.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
from tensordict import TensorDict

from spmd_rl.storage.writer import DEFAULT_FLUSH_EVERY_S, HDF5Writer


class ExperienceLog:
    """Every transition a rank's trainer consumes, appended to <run_dir>/buffer/experience_rank<R>.h5.

    Reopening a run's log continues it. Rows of a rollout [T, N, ...] are stored time-major (row t * N + n).
    """

    def __init__(
        self,
        run_dir: str | os.PathLike,
        rank: int,
        example_td: TensorDict,
        *,
        chunk_rows: int | None = None,
        compression: str | None = None,
        flush_every_s: float = DEFAULT_FLUSH_EVERY_S,
        group_names: list[str] | None = None,
        must_exist: bool = False,
    ):
        """group_names: with env groups, the names of the group indices the rollouts' `group` column holds,
        stored as the file's group_names attribute (JSON). must_exist: a missing file is an error, not a new one."""
        self.path = Path(run_dir) / "buffer" / f"experience_rank{rank}.h5"
        self._writer = HDF5Writer(
            self.path,
            example_td,
            chunk_rows=chunk_rows,
            compression=compression,
            flush_every_s=flush_every_s,
            attributes={"group_names": json.dumps(group_names)} if group_names else None,
            must_exist=must_exist,  # resuming from a checkpoint: the rows it counts are in this file
        )

    def append(self, td_rollout: TensorDict, policy_version: int, env_step: int, steps_per_row: int = 1) -> None:
        """Append a rollout shaped [T, N, ...] (or rows [B, ...]).

        env_id of row (t, n) is n, the env's index on this rank; env_step is the rank's env-step counter at the
        rollout's first step, in primitive env steps, so row (t, n) gets env_step + (t * N + n) * steps_per_row: one
        distinct number per transition (a decision of an action chunk counts as its K steps: steps_per_row K).
        """
        envs = td_rollout.batch_size[1] if td_rollout.batch_dims == 2 else 1
        rows = td_rollout.batch_size.numel()
        row = np.arange(rows, dtype=np.int64)
        self._writer.append(
            td_rollout, policy_version=policy_version, env_id=row % envs, env_step=env_step + row * steps_per_row
        )

    @property
    def total_rows(self) -> int:
        """Rows logged so far: the cursor a checkpoint saves."""
        return self._writer.total_rows

    def rewind(self, total_rows: int) -> None:
        """Forget the rows logged after the first total_rows (resuming from a checkpoint that saved it)."""
        self._writer.rewind(total_rows)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()

    def __len__(self) -> int:
        return len(self._writer)
