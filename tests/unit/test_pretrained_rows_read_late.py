"""A sharded trainer reads its own rows of a pretrained folder after the checks before start read the files'
headers (modules/pretrained.py, read_rows): a file damaged or replaced in between is one UserError naming the file
(exit 2, one line), not a SafetensorError traceback on every trainer and exit 1 (fault pass 6, V5: the folder's
first shard truncated while the ranks started)."""

from __future__ import annotations

import pytest
import torch

from spmd_rl.modules.pretrained import read_rows
from spmd_rl.runtime.errors import UserError

safetensors_torch = pytest.importorskip("safetensors.torch")


def _file(tmp_path):
    path = tmp_path / "model.safetensors"
    safetensors_torch.save_file({"w": torch.arange(4096, dtype=torch.float32).reshape(64, 64)}, str(path))
    return path


def test_rows_are_read_from_an_intact_file(tmp_path):
    path = _file(tmp_path)
    rows = read_rows((path, "w"), 32, 64)
    torch.testing.assert_close(rows, torch.arange(2048, 4096, dtype=torch.float32).reshape(32, 64))


@pytest.mark.parametrize("damage", ["truncated", "removed", "not safetensors"])
def test_a_file_damaged_after_the_checks_is_a_user_error_naming_it(tmp_path, damage):
    path = _file(tmp_path)
    if damage == "truncated":
        with path.open("r+b") as handle:
            handle.truncate(path.stat().st_size // 2)
    elif damage == "removed":
        path.unlink()
    else:
        path.write_bytes(b"\xff" * 100)
    with pytest.raises(UserError, match="model.safetensors cannot be read as a safetensors file") as caught:
        read_rows((path, "w"), 32, 64)
    assert "restore the folder" in str(caught.value)
