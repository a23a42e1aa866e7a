"""A stop signal as the run ends: its line and what the run does agree. Before the last iteration's boundary the run
stops there with its checkpoint (exit 75, 'stopping after this iteration'); once that boundary is reached no
boundary is left to stop at, so the run finishes (exit 0) and the line says so instead of promising a stop (fault
pass 2026-12-07, case SD: the line promised a stop and the run finished)."""

from __future__ import annotations

import datetime
import signal

import pytest
import torch

from spmd_rl.config import load_config
from spmd_rl.persist.run_control import RunControl, StoppedWithCheckpoint
from spmd_rl.runtime import signals

ITERATIONS = 3


@pytest.fixture
def graceful(monkeypatch):
    """The engine loop's signal state, as stop_at_iteration_boundary(True) leaves it, restored afterwards; rank 0
    alone and no launcher's failure records, so the line is printed at once."""
    for name in ("RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID", "SPMD_RL_FAILURE_DIR"):
        monkeypatch.delenv(name, raising=False)
    for attribute in ("enabled", "requested", "requested_at", "finishing", "too_late"):
        monkeypatch.setattr(signals._Graceful, attribute, getattr(signals._Graceful, attribute, None), raising=False)
    signals.stop_at_iteration_boundary(True)


def control(tmp_path) -> RunControl:
    cfg = load_config(None, ["checkpoint.every_s=0", "checkpoint.every_iterations=0"])
    timeout = datetime.timedelta(seconds=20)
    return RunControl(cfg, ITERATIONS, rank=0, world_size=1, distributed=False, run_dir=tmp_path, timeout=timeout)


def end_iterations(rc: RunControl, signal_in_capture_of: int | None = None) -> None:
    """after_iteration for every iteration; SIGTERM's handler runs inside the checkpoint capture of one of them
    (after that iteration's agreement, while its checkpoint is written)."""

    def capture_at(iteration: int):
        def capture() -> dict:
            if iteration == signal_in_capture_of:
                signals._on_signal(signal.SIGTERM, None)
            return {"payload": torch.tensor([float(iteration)])}

        return capture

    for iteration in range(ITERATIONS):
        rc.after_iteration(iteration, capture_at(iteration))


def test_a_stop_before_the_last_boundary_stops_there_as_its_line_says(tmp_path, graceful, capsys):
    rc = control(tmp_path)
    for iteration in range(ITERATIONS - 1):
        rc.after_iteration(iteration, lambda: {})
    signals._on_signal(signal.SIGTERM, None)  # during the last iteration
    assert "SIGTERM: stopping after this iteration with a checkpoint" in capsys.readouterr().err
    with pytest.raises(StoppedWithCheckpoint, match=f"stopped by SIGTERM after iteration {ITERATIONS - 1}"):
        rc.after_iteration(ITERATIONS - 1, lambda: {"payload": torch.zeros(1)})


@pytest.mark.parametrize("when", ["while the last checkpoint is written", "after the last iteration"])
def test_a_stop_past_the_last_boundary_lets_the_run_finish_and_its_line_says_so(tmp_path, graceful, capsys, when):
    rc = control(tmp_path)
    end_iterations(rc, signal_in_capture_of=ITERATIONS - 1 if when.startswith("while") else None)
    if when == "after the last iteration":  # saving policy.pt, finished.json, the last evaluation
        signals._on_signal(signal.SIGTERM, None)
    said = capsys.readouterr().err
    assert "SIGTERM: the last iteration is done: the run finishes (exit 0, nothing to resume)" in said, said
    assert "stopping after this iteration" not in said
    assert signals.requested_stop() is None  # nothing left to act on: the run finishes
    assert rc.store.latest() == tmp_path / "checkpoints" / f"iter_{ITERATIONS - 1:09d}"
    # a second signal after the repeat window still stops at once
    signals._Graceful.requested_at = -1e9
    with pytest.raises(signals.StopSignal):
        signals._on_signal(signal.SIGTERM, None)
