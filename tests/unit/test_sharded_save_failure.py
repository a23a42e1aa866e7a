"""A sharded save that fails is one line, exit 2: DCP gathers every trainer's failure into its CheckpointException,
a BaseException, which `except Exception` let through as a 160-line traceback on every trainer and exit 1 when the
disk filled during the save (fault pass 5, W1: two fsdp trainers, run.dir on a 1.5 MB tmpfs; torch's zip writer
words the short write "unexpected pos 704 vs 598"). A full file system is said as every other write says it."""

import errno
from types import SimpleNamespace

import pytest
import torch.distributed.checkpoint as dcp

from spmd_rl.persist import checkpoint
from spmd_rl.runtime.errors import UserError


def failing_save(cause: BaseException):
    def save(*args, **kwargs):
        raise dcp.CheckpointException("write", {0: (cause, None)})

    return save


@pytest.fixture
def shards(monkeypatch):
    monkeypatch.setattr(checkpoint, "mesh_trainers", lambda mesh: None)
    return {"policy.weight": SimpleNamespace(device_mesh=None)}


@pytest.mark.parametrize(
    "cause, full, said",
    [
        (RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"), True, "disk full"),
        (OSError(errno.ENOSPC, "No space left on device"), False, "disk full"),
        (RuntimeError("something else"), False, "failed: something else"),
    ],
)
def test_a_failed_sharded_save_is_one_line(tmp_path, monkeypatch, shards, cause, full, said):
    monkeypatch.setattr(dcp, "save", failing_save(cause))
    monkeypatch.setattr(checkpoint, "_no_space_left", lambda directory: full, raising=False)
    with pytest.raises(UserError) as refused:
        checkpoint.save_shards(shards, tmp_path)
    line = str(refused.value)
    assert str(tmp_path) in line and said in line and "\n" not in line, line
