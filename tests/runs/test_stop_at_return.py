"""run.stop_at_return: once rank 0's mean return of the last episodes reaches the threshold, every rank stops at
the same iteration (agreed in the end-of-iteration all_reduce) with a checkpoint; the run is finished, exit 0."""

import datetime
import json
from pathlib import Path

import pytest
from harness.multiproc import assert_all_ok, run_ranks
from harness.parts import run_iterations as run
from harness.runs import TINY, run_main

from spmd_rl.config import load_config
from spmd_rl.persist.run_control import ReachedReturn, RunControl
from spmd_rl.runtime import signals

RETURNS = [10.0, 40.0, 90.0, 120.0, 130.0]  # rank 0's mean return after each iteration


def _stop_where_rank_0_says(rank, world_size, cfg, run_dir):
    signals._Graceful.requested, signals._Graceful.enabled = None, False  # this forked child's own state
    timeout = datetime.timedelta(seconds=20)
    rc = RunControl(cfg, 5, rank=rank, world_size=world_size, distributed=True, run_dir=Path(run_dir), timeout=timeout)
    seen = []
    if rank == 0:
        rc.mean_return = lambda: RETURNS[len(seen) - 1]
    else:  # the other ranks keep no metrics: only rank 0's return counts, and theirs would say "reached"
        rc.mean_return = lambda: 1e9
    with pytest.raises(
        ReachedReturn,
        match=r"reached run.stop_at_return=100 \(mean return of the last episodes "
        r"120.00\) after iteration 3; checkpoint .*iter_000000003; the run is finished",
    ):
        for iteration in range(5):
            seen.append(iteration)
            assert run(rc, range(iteration, iteration + 1)) == [], "no checkpoint before the threshold"
    assert seen == [0, 1, 2, 3], "every rank stops at iteration 3"
    rc.wait_for_stop_files()
    assert rc.store.latest() == Path(run_dir) / "checkpoints" / "iter_000000003"


def test_every_rank_stops_at_the_iteration_rank_0s_return_reached_the_threshold(tmp_path):
    cfg = load_config(None, ["checkpoint.every_s=0", "checkpoint.every_iterations=0", "run.stop_at_return=100"])
    assert_all_ok(run_ranks(_stop_where_rank_0_says, 3, cfg, str(tmp_path), timeout_s=20))


@pytest.mark.slow
def test_a_run_that_reaches_its_return_finishes_early_with_exit_0_a_checkpoint_and_a_line(tmp_path):
    run_dir = tmp_path / "run"
    result = run_main("--config", TINY, f"run.dir={run_dir}", "run.stop_at_return=5")  # CartPole: >= 8 an episode
    assert result.returncode == 0, result.stderr[-3000:]
    (line,) = [line for line in result.stdout.splitlines() if "run.stop_at_return" in line]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    first = next(r["iteration"] for r in records if (r["episode_return_mean"] or 0) >= 5)
    assert [r["iteration"] for r in records] == list(range(first + 1)) and first < 7
    assert line.startswith("spmd_rl: reached run.stop_at_return=5 (mean return of the last episodes ")
    assert line.endswith(
        f"after iteration {first}; checkpoint {run_dir}/checkpoints/iter_{first:09d}; the run is finished"
    )
    assert (run_dir / "finished.json").is_file() and (run_dir / "policy.pt").is_file()
