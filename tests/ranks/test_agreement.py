"""Every rank must run rank 0's exact config and share rank 0's run directory."""

import pytest
from harness.multiproc import assert_all_ok, run_ranks
from harness.parts import gloo_runtime as _runtime

from spmd_rl.config.loading import load_config
from spmd_rl.run.resume import agree_on_run as _agree_on_run
from spmd_rl.runtime.errors import UserError


def _agree(rank, world_size, run_dir, seed_of_rank):
    cfg = load_config(
        None, [f"run.dir={run_dir}" if rank == 0 else "run.dir=", f"train.seed={seed_of_rank.get(rank, 1)}"]
    )
    if seed_of_rank:
        with pytest.raises(UserError, match=r"rank\(s\) \[2\] run a different config than rank 0"):
            _agree_on_run(cfg, _runtime(rank, world_size))
        return
    path, resume = _agree_on_run(cfg, _runtime(rank, world_size))
    assert str(path) == run_dir, "every rank uses rank 0's run directory"
    assert resume.checkpoint is None and resume.start_iteration == 0


def test_ranks_share_rank0_run_dir_and_config(tmp_path):
    assert_all_ok(run_ranks(_agree, 3, str(tmp_path / "run"), {}, timeout_s=20))
    assert (tmp_path / "run" / "config.yaml").is_file()


def test_a_rank_with_a_different_config_fails_everywhere(tmp_path):
    assert_all_ok(run_ranks(_agree, 3, str(tmp_path / "run"), {2: 7}, timeout_s=20))
