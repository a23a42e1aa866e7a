"""A sharded checkpoint read whole in one process (python -m spmd_rl.evaluate, run.init_from) whose shard files are
not all there is one line and exit 2 naming the file, not torch.distributed.checkpoint's traceback and exit 1
(fault pass 4, L4b: `evaluate <run>/checkpoints/latest` after trainer 1's shard file went missing; rank 0's file
lists only the shard files trainer 0 wrote, so their checksums passed)."""

import pytest
import torch
import torch.distributed.checkpoint as dcp

from spmd_rl.persist.checkpoint import SHARDED, SHARDS_DIR, load_shards
from spmd_rl.runtime.errors import UserError


def test_a_missing_shard_file_is_a_user_error_naming_it(tmp_path):
    dcp.save({"weight": torch.ones(4)}, storage_writer=dcp.FileSystemWriter(tmp_path / SHARDS_DIR), no_dist=True)
    (shard,) = (tmp_path / SHARDS_DIR).glob("*.distcp")
    shard.unlink()
    with pytest.raises(UserError, match=f"its shard files cannot be read .*{shard.name}"):
        load_shards({"policy": {"weight": {SHARDED: "weight"}}}, tmp_path)
