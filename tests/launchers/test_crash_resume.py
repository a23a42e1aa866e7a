"""A kill -9 right after a checkpoint never makes a run unresumable (issue 19, item 1).

A checkpoint records the row count of every HDF5 writer (the experience log, the hdf5 replay buffer). Rows are
staged in memory before they are written, so the count recorded must be of rows already written and committed:
otherwise a kill -9 right after `checkpoints/latest` changes leaves a file with fewer rows than the checkpoint
counts, and every rerun exits 2 ("cannot rewind to 64 rows; 0 have been appended").
"""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from spmd_rl.storage.experience_log import ExperienceLog
from spmd_rl.storage.reader import HDF5Reader
from spmd_rl.storage.replay import ReplayBuffer

ROOT = Path(__file__).resolve().parents[2]
PYTHON = sys.executable

# -------------------------------------------------------------------------------------------------------------------
# The state a checkpoint takes, then os._exit: no close, no flush on the way out (what kill -9 leaves).

TAKE_STATE_THEN_DIE = textwrap.dedent("""
    import json, os, sys
    import torch
    from tensordict import TensorDict
    from spmd_rl.roles.trainer import Trainer
    from spmd_rl.storage.experience_log import ExperienceLog
    from spmd_rl.storage.replay import ReplayBuffer

    class Algorithm:
        def state_dict(self):
            return {}

    def rows(first, count):
        ids = torch.arange(first, first + count)
        return TensorDict({"id": ids, "obs": ids[:, None].float().expand(count, 3).clone()}, batch_size=[count])

    run_dir = sys.argv[1]
    # flush_every_s=inf: only a flush writes, so every row appended so far is staged in memory.
    log = ExperienceLog(run_dir, 0, rows(0, 1), flush_every_s=float("inf"))
    trainer = Trainer(Algorithm(), [], [], 1, None, experience_log=log, policy=torch.nn.Linear(1, 1))
    replay = ReplayBuffer(
        64, rows(0, 1), backend="hdf5", path=os.path.join(run_dir, "replay.h5"), flush_every_s=float("inf")
    )
    for first in range(0, 40, 8):
        log.append(rows(first, 8), policy_version=0, env_step=first)
        replay.add(rows(first, 8))
    state = {"experience_rows": trainer.state_dict()["experience_rows"], "replay": replay.state_dict()}
    log.append(rows(40, 8), policy_version=0, env_step=40)  # rows after the checkpoint: lost, which is fine
    replay.add(rows(40, 8))
    print(json.dumps(state), flush=True)
    os._exit(0)
""")


def example_rows(count: int = 1):
    from tensordict import TensorDict

    ids = torch.arange(count)
    return TensorDict({"id": ids, "obs": ids[:, None].float().expand(count, 3).clone()}, batch_size=[count])


def test_the_row_counts_a_checkpoint_records_are_on_disk_when_the_process_dies(tmp_path):
    child = subprocess.run(
        [PYTHON, "-c", TAKE_STATE_THEN_DIE, str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert child.returncode == 0, child.stderr[-3000:]
    state = json.loads(child.stdout.splitlines()[-1])
    assert state["experience_rows"] == 40 and state["replay"]["total_rows"] == 40

    # Reopen what the dead process left and rewind to the recorded counts, as a resume does.
    log = ExperienceLog(tmp_path, 0, example_rows())
    log.rewind(state["experience_rows"])
    assert log.total_rows == 40
    log.close()
    replay = ReplayBuffer(64, example_rows(), backend="hdf5", path=tmp_path / "replay.h5")
    replay.load_state_dict(state["replay"])
    assert len(replay) == 40
    assert replay.read(torch.arange(40))["id"].tolist() == list(range(40))
    replay.close()


# -------------------------------------------------------------------------------------------------------------------
# Real runs, killed with SIGKILL as soon as `checkpoints/latest` changes, then rerun.

PPO_LOG = [
    "--config",
    str(ROOT / "configs" / "ci_tiny.yaml"),
    "buffer.log_experience=true",
    "checkpoint.every_iterations=2",
    "train.total_steps=2048",
]
SAC_HDF5 = [
    "--config",
    str(ROOT / "configs" / "sac_pendulum.yaml"),
    "buffer.backend=hdf5",
    "checkpoint.every_iterations=2",
    "train.total_steps=1200",
    "algo.learning_starts=64",
    "algo.batch_size=32",
    "policy.hidden_sizes=[16]",
    "algo.critic_hidden_sizes=[16]",
    "log.progress=false",
    "log.tensorboard=false",
]
# flush_every_s=60: no staged row is written by the time bound within the few seconds of a run, so a checkpoint
# always finds rows staged (as it does with the default 2 s whenever the kill follows the checkpoint closely).
STAGED = ["buffer.flush_every_s=60"]


def _main(args: list[str], run_dir: Path) -> list[str]:
    return [PYTHON, "-m", "spmd_rl.main", *args, *STAGED, f"run.dir={run_dir}"]


def _latest(run_dir: Path) -> str | None:
    try:
        return (run_dir / "checkpoints" / "latest").read_text().strip() or None
    except OSError:
        return None


def kill_when_latest_changes(args: list[str], run_dir: Path, timeout: float = 120) -> str:
    """Run main; SIGKILL it as soon as checkpoints/latest names another checkpoint than at start. Returns it."""
    before = _latest(run_dir)
    child = subprocess.Popen(_main(args, run_dir), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + timeout
    try:
        while child.poll() is None and time.monotonic() < deadline:
            now = _latest(run_dir)
            if now is not None and now != before:
                os.kill(child.pid, signal.SIGKILL)
                child.wait(30)
                return now
            time.sleep(0.001)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(30)
    raise AssertionError(
        f"the run ended (rc {child.returncode}) before checkpoints/latest changed from {before}: "
        f"{child.stderr.read().decode()[-2000:]}"
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "args", [pytest.param(PPO_LOG, id="ppo_experience_log"), pytest.param(SAC_HDF5, id="sac_hdf5")]
)
def test_kill_9_right_after_a_checkpoint_resumes_and_ends_as_an_uninterrupted_run(tmp_path, args):
    reference = subprocess.run(_main(args, tmp_path / "reference"), cwd=ROOT, capture_output=True, text=True)
    assert reference.returncode == 0, reference.stderr[-3000:]

    run_dir = tmp_path / "killed"
    killed_at = [kill_when_latest_changes(args, run_dir)]  # the first checkpoint
    killed_at.append(kill_when_latest_changes(args, run_dir))  # a resumed run, at its first checkpoint
    assert killed_at[0] < killed_at[1], killed_at
    rerun = subprocess.run(_main(args, run_dir), cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert rerun.returncode == 0, f"killed at {killed_at}: {rerun.stderr[-3000:]}"

    # Resumed exactly: the same weights and the same metrics as the run never killed.
    final = torch.load(run_dir / "policy.pt", weights_only=True)
    expected = torch.load(tmp_path / "reference" / "policy.pt", weights_only=True)
    assert final.keys() == expected.keys() and all(torch.equal(final[k], expected[k]) for k in final)
    ours, theirs = ((d / "metrics.jsonl").read_text().splitlines() for d in (run_dir, tmp_path / "reference"))
    assert len(ours) == len(theirs)
    strip = ("time", "sps", "_s")  # wall-clock figures differ between runs
    for mine, reference_record in zip(map(json.loads, ours), map(json.loads, theirs)):
        for key, value in reference_record.items():
            if not any(part in key for part in strip):
                assert mine[key] == value, (key, mine[key], value)

    # And the same HDF5 rows, every column (the experience log's episode statistics on rows where no episode ended
    # were leftovers of an earlier rollout, which a resumed run's fresh buffers did not have).
    files = sorted(path.relative_to(tmp_path / "reference") for path in (tmp_path / "reference").rglob("*.h5"))
    assert files and files == sorted(path.relative_to(run_dir) for path in run_dir.rglob("*.h5"))
    for name in files:
        with HDF5Reader(tmp_path / "reference" / name) as reference_file, HDF5Reader(run_dir / name) as resumed:
            expected_rows, resumed_rows = reference_file.read(meta=True), resumed.read(meta=True)
            assert expected_rows.keys() == resumed_rows.keys()
            for column, values in expected_rows.items():
                assert np.array_equal(values, resumed_rows[column], equal_nan=True), (name, column)
