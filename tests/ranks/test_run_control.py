"""RunControl at the end of every iteration: checkpoints at checkpoint.every_iterations and the last iteration,
`keep` pruning, run.stop_after_iterations and a requested stop (a signal) ending with a committed checkpoint that
a rerun resumes from; across ranks, a stop that only one rank was asked for and rank 0's checkpoint clock are
agreed, so every rank saves and stops at the same iteration."""

from __future__ import annotations

import datetime
import signal
import time
from pathlib import Path

import pytest
import torch
from harness.multiproc import assert_all_ok, run_ranks
from harness.parts import run_iterations as run

from spmd_rl.config import load_config
from spmd_rl.persist.checkpoint import COMPLETE, CheckpointStore, load_checkpoint
from spmd_rl.persist.run_control import RunControl, StoppedWithCheckpoint
from spmd_rl.run.resume import Resume, decide_resume
from spmd_rl.runtime import signals

TIMEOUT = datetime.timedelta(seconds=20)


def config(*overrides: str):
    return load_config(None, ["checkpoint.every_s=0", *overrides])


def checkpoints(run_dir: Path) -> list[str]:
    root = run_dir / "checkpoints"
    return sorted(d.name for d in root.iterdir() if d.is_dir()) if root.is_dir() else []


@pytest.fixture
def no_stop_requested(monkeypatch):
    """A clean stop request state for this test, restored afterwards: a RunControl that reached its last iteration
    leaves `finishing` set in this process, and a later test's stop would read as one past the run's end."""
    for attribute, value in (("requested", None), ("requested_at", None), ("enabled", False)):
        monkeypatch.setattr(signals._Graceful, attribute, value)
    for attribute in ("finishing", "too_late"):
        monkeypatch.setattr(signals._Graceful, attribute, False)


def control(cfg, run_dir: Path, num_iterations: int) -> RunControl:
    return RunControl(cfg, num_iterations, rank=0, world_size=1, distributed=False, run_dir=run_dir, timeout=TIMEOUT)


def test_checkpoints_at_every_iterations_and_the_last_keep_prunes(tmp_path, no_stop_requested):
    rc = control(config("checkpoint.every_iterations=3", "checkpoint.keep=2"), tmp_path, num_iterations=8)
    assert run(rc, range(8)) == [2, 5, 7]
    assert checkpoints(tmp_path) == ["iter_000000005", "iter_000000007"]
    store = CheckpointStore(tmp_path)
    assert store.latest() == tmp_path / "checkpoints" / "iter_000000007"
    state = load_checkpoint(store.latest(), rank=0)
    assert state["iteration"] == 7 and torch.equal(state["payload"], torch.tensor([7.0])) and "rng" in state
    assert float(load_checkpoint(tmp_path / "checkpoints" / "iter_000000005", 0)["payload"]) == 5.0


def test_keep_one_and_no_periodic_checkpoints_leaves_only_the_last(tmp_path, no_stop_requested):
    rc = control(config("checkpoint.every_iterations=0", "checkpoint.keep=1"), tmp_path, num_iterations=4)
    assert run(rc, range(4)) == [3]
    assert checkpoints(tmp_path) == ["iter_000000003"]
    rc = control(config("checkpoint.every_iterations=1", "checkpoint.keep=1"), tmp_path / "b", num_iterations=4)
    assert run(rc, range(4)) == [0, 1, 2, 3]
    assert checkpoints(tmp_path / "b") == ["iter_000000003"]


def test_a_resumed_run_checkpoints_at_the_same_iterations(tmp_path, no_stop_requested):
    rc = control(config("checkpoint.every_iterations=4"), tmp_path, num_iterations=10)
    assert run(rc, range(5, 10)) == [7, 9]  # multiples of every_iterations, not of the start


def test_stop_after_iterations_raises_with_a_committed_checkpoint_that_resume_finds(tmp_path, no_stop_requested):
    cfg = config("run.stop_after_iterations=3", "checkpoint.every_iterations=0")
    rc = control(cfg, tmp_path, num_iterations=10)
    assert run(rc, range(2)) == []
    with pytest.raises(
        StoppedWithCheckpoint,
        match=r"stopped by run.stop_after_iterations=3 after iteration 2; "
        r"checkpoint .*iter_000000002",
    ) as stopped:
        run(rc, range(2, 3))
    directory = tmp_path / "checkpoints" / "iter_000000002"
    assert stopped.value.checkpoint == directory
    assert (directory / COMPLETE).is_file() and CheckpointStore(tmp_path).latest() == directory
    assert load_checkpoint(directory, 0)["iteration"] == 2
    # The rerun (same command, run.resume=auto) starts at iteration 3 from that checkpoint.
    (tmp_path / "config.yaml").write_text(cfg.to_yaml())
    resume = decide_resume(cfg, tmp_path, world_size=1)
    assert resume == Resume(checkpoint=directory, iteration=2) and resume.start_iteration == 3


def test_stop_after_the_last_iteration_is_just_the_end(tmp_path, no_stop_requested):
    rc = control(config("run.stop_after_iterations=4"), tmp_path, num_iterations=4)
    assert run(rc, range(4)) == [3]  # no StoppedWithCheckpoint: the run is complete


def test_a_requested_stop_checkpoints_and_raises_at_the_next_iteration_end(tmp_path, no_stop_requested):
    rc = control(config("checkpoint.every_iterations=0"), tmp_path, num_iterations=10)
    assert run(rc, range(2)) == []
    signals.stop_at_iteration_boundary(True)
    signals._on_signal(signal.SIGTERM, None)  # what the installed handler runs on SIGTERM
    assert signals.requested_stop() == ("SIGTERM", signal.SIGTERM)
    with pytest.raises(StoppedWithCheckpoint, match="stopped by SIGTERM after iteration 2"):
        run(rc, range(2, 3))
    assert checkpoints(tmp_path) == ["iter_000000002"] and CheckpointStore(tmp_path).latest() is not None


@pytest.mark.parametrize("meanwhile", ["nothing", "a rank failed", "the run ended"])
def test_a_stop_is_announced_unless_a_rank_failed_or_the_run_ended_meanwhile(
    tmp_path, monkeypatch, capsys, no_stop_requested, meanwhile
):
    # Under a launcher that keeps failure records, mpirun's SIGTERM after a rank died can arrive before any
    # survivor's record: the line waits ANNOUNCE_AFTER_S and is dropped if a record appeared by then (or if the run
    # ended first: no thread may print while the process exits).
    monkeypatch.setenv("SPMD_RL_FAILURE_DIR", str(tmp_path))
    monkeypatch.setattr(signals._Graceful, "enabled", True)
    signals._on_signal(signal.SIGTERM, None)
    assert signals.requested_stop() == ("SIGTERM", signal.SIGTERM) and "stopping" not in capsys.readouterr().err
    if meanwhile == "a rank failed":
        (tmp_path / "rank2.json").write_text("{}")  # a survivor's record, written just after the signal
    elif meanwhile == "the run ended":
        signals.stop_at_iteration_boundary(False)
    time.sleep(signals.ANNOUNCE_AFTER_S + 0.5)
    said = capsys.readouterr().err
    assert ("SIGTERM: stopping after this iteration with a checkpoint" in said) == (meanwhile == "nothing"), said


@pytest.mark.parametrize("rank", ["0", "1", None])
def test_a_stop_is_acknowledged_by_rank_0_alone(monkeypatch, capsys, no_stop_requested, rank):
    # Ctrl-C in a terminal reaches every rank of the job at once: one acknowledgement, rank 0's (a rank started
    # alone, with no launcher's rank variable, is rank 0); the final stop line is rank 0's too.
    monkeypatch.delenv("SPMD_RL_FAILURE_DIR", raising=False)
    for name in ("RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    if rank is not None:
        monkeypatch.setenv("RANK", rank)
    monkeypatch.setattr(signals._Graceful, "enabled", True)
    signals._on_signal(signal.SIGINT, None)
    assert signals.requested_stop() == ("SIGINT", signal.SIGINT)  # every rank still asks for the stop
    said = capsys.readouterr().err
    assert ("SIGINT: stopping after this iteration with a checkpoint" in said) == (rank != "1"), said


def test_checkpoint_every_s_is_due_by_the_clock(tmp_path, no_stop_requested):
    rc = control(
        load_config(None, ["checkpoint.every_s=600", "checkpoint.every_iterations=0"]), tmp_path, num_iterations=10
    )
    assert run(rc, range(2)) == []
    rc.last_checkpoint = time.monotonic() - 601
    assert run(rc, range(2, 4)) == [2]  # due once, then the clock starts again
    assert checkpoints(tmp_path) == ["iter_000000002"]


def _agree_across_ranks(rank, world_size, cfg, run_dir):
    signals._Graceful.requested, signals._Graceful.enabled = None, False  # this forked child's own state
    signals._Graceful.finishing = signals._Graceful.too_late = False
    rc = RunControl(cfg, 10, rank=rank, world_size=world_size, distributed=True, run_dir=Path(run_dir), timeout=TIMEOUT)
    # Only rank 0's clock counts: rank 1 believing a timed checkpoint is due changes nothing ...
    if rank == 1:
        rc.last_checkpoint = time.monotonic() - 10_000
    assert run(rc, range(0, 1)) == []
    # ... rank 0 believing it makes every rank save.
    if rank == 0:
        rc.last_checkpoint = time.monotonic() - 10_000
    assert run(rc, range(1, 3)) == [1]
    # A stop only rank 1 was asked for (the signal handler's own path) stops both at the same iteration.
    if rank == 1:
        signals.stop_at_iteration_boundary(True)
        signals._on_signal(signal.SIGUSR1, None)
    with pytest.raises(StoppedWithCheckpoint, match="stopped by SIGUSR1 after iteration 3") as stopped:
        run(rc, range(3, 4))
    assert signals.requested_stop() == (("SIGUSR1", signal.SIGUSR1) if rank == 1 else None)
    rc.wait_for_stop_files()  # rank 0 has committed by now
    directory = Path(run_dir) / "checkpoints" / "iter_000000003"
    assert stopped.value.checkpoint == directory
    assert CheckpointStore(run_dir).latest() == directory
    for r in range(world_size):
        state = load_checkpoint(directory, r)
        assert state["rank"] == r and state["iteration"] == 3
    assert checkpoints(Path(run_dir)) == ["iter_000000001", "iter_000000003"]


def test_ranks_agree_on_a_stop_only_one_was_asked_for_and_on_rank_0s_clock(tmp_path):
    cfg = load_config(None, ["checkpoint.every_s=600", "checkpoint.every_iterations=0"])
    assert_all_ok(run_ranks(_agree_across_ranks, 2, cfg, str(tmp_path), timeout_s=20))


def _gather_rank_facts(rank, world_size, cfg, run_dir):
    signals._Graceful.requested, signals._Graceful.enabled = None, False  # this forked child's own state
    signals._Graceful.finishing = signals._Graceful.too_late = False
    rc = RunControl(cfg, 3, rank=rank, world_size=world_size, distributed=True, run_dir=Path(run_dir), timeout=TIMEOUT)
    asked = []
    rc.rank_facts = lambda: asked.append(1) or (float(rank), 10.0 * rank + 0.5)
    run(rc, range(2))
    assert asked == [] and rc.gathered_facts == []  # not the last agreement, no run.stop_at_return: nothing asked
    run(rc, range(2, 3))
    assert rc.gathered_facts == [(float(r), 10.0 * r + 0.5) for r in range(world_size)]


def test_the_last_agreement_gathers_every_ranks_facts_in_rank_order(tmp_path):
    cfg = config("checkpoint.every_iterations=0")
    assert_all_ok(run_ranks(_gather_rank_facts, 3, cfg, str(tmp_path), timeout_s=20))
