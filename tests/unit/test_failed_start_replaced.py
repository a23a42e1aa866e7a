"""A run directory that holds only a failed start of another config (its config.yaml, no iteration's record, no
checkpoint) does not refuse the corrected command: the fault pass of 2026-12-07 (B7) ran `run.init_from` at a
missing folder, the start failed after writing config.yaml, and the corrected command, another config, was then
refused with "holds a run with a different config". A directory where an iteration was recorded still refuses."""

from __future__ import annotations

import pytest

from spmd_rl.config.loading import load_config
from spmd_rl.persist.run_files import CONFIG_FILE, METRICS_FILE
from spmd_rl.run.resume import decide_resume
from spmd_rl.runtime.errors import UserError


def _failed_start(run_dir, *overrides: str):
    (run_dir / CONFIG_FILE).write_text(load_config(None, ["algo.learning_rate=0.5", *overrides]).to_yaml())
    return load_config(None, [f"run.dir={run_dir}"])


def test_a_failed_start_of_another_config_is_replaced(tmp_path):
    cfg = _failed_start(tmp_path)
    (tmp_path / METRICS_FILE).write_text("")  # opened, never written: no iteration ended
    resume = decide_resume(cfg, tmp_path, world_size=1)
    assert resume.checkpoint is None
    assert "held a start of another config that ended before its first iteration: replaced" in resume.fallback


@pytest.mark.parametrize("metrics", ['{"iteration": 0}\n', None])
def test_another_config_with_a_recorded_iteration_or_unreadable_records_is_refused(tmp_path, metrics):
    cfg = _failed_start(tmp_path)
    if metrics is None:
        (tmp_path / METRICS_FILE).mkdir()  # not a file: what it holds is unknown, so it is kept
    else:
        (tmp_path / METRICS_FILE).write_text(metrics)
    with pytest.raises(UserError, match="holds a run with a different config"):
        decide_resume(cfg, tmp_path, world_size=1)
