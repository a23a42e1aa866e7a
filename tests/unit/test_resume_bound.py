"""A resume keeps this run's dist.timeout_s as the process's watchdog bound: deciding where to resume loads the
earlier run's config.yaml (whose dist.timeout_s may differ: it is no part of the resume digest), and loading a
config bounds the watchdog by its own value. A MetaWorld SFT run resumed with dist.timeout_s=1800 was stopped at an
evaluation after the earlier config's 300 s (benchmarks/README.md, issue 45's section)."""

from __future__ import annotations

from spmd_rl.config.loading import load_config
from spmd_rl.persist.run_files import CONFIG_FILE
from spmd_rl.run.resume import decide_resume
from spmd_rl.runtime.watchdog import watchdog


def test_a_resume_keeps_this_runs_watchdog_bound(tmp_path):
    (tmp_path / CONFIG_FILE).write_text(load_config(None, ["dist.timeout_s=300"]).to_yaml())
    cfg = load_config(None, ["dist.timeout_s=1800", f"run.dir={tmp_path}"])
    kept = (watchdog.timeout_s, watchdog.who, watchdog.on_expiry)
    watchdog.configure(cfg.dist.timeout_s, "rank 0")
    try:
        resume = decide_resume(cfg, tmp_path, world_size=1)
        assert resume.checkpoint is None  # the same run (another timeout is no other run), before a checkpoint
        assert watchdog.timeout_s == 1800
    finally:
        watchdog.configure(*kept)
