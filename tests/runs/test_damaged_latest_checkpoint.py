"""A damaged newest checkpoint (a rank file or a shard file whose bytes changed) falls back to the older complete
checkpoint, as docs/storage-and-resume.md promises: one note line, and the run goes on from there exactly. With
checkpoint.keep: 1 there is no older one: one line, exit 2, and no advice to delete the only checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
from harness.runs import TINY, assert_one_line_exit_2, assert_same_run, run_main

from spmd_rl.persist.checkpoint import CheckpointStore

ARGS = ["--config", TINY, "train.seed=6", "log.progress=false", "log.tensorboard=false"]


def _flip_a_byte(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    file.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "parallel,damaged", [("ddp", "rank0.pt"), ("fsdp", "shards/__0_0.distcp")], ids=["rank-file", "shard-file"]
)
def test_a_damaged_newest_checkpoint_falls_back_to_the_older_one(tmp_path, parallel, damaged):
    args = [*ARGS, f"train.parallel={parallel}", "checkpoint.every_iterations=2"]
    whole = run_main(*args, f"run.dir={tmp_path / 'whole'}")
    assert whole.returncode == 0, whole.stderr[-3000:]
    run_dir = tmp_path / "halves"
    stopped = run_main(*args, f"run.dir={run_dir}", "run.stop_after_iterations=4")
    assert stopped.returncode == 75, stopped.stderr[-3000:]
    newest = CheckpointStore(run_dir).latest()
    assert newest is not None and newest.name == "iter_000000003"
    _flip_a_byte(newest / damaged)
    resumed = run_main(*args, f"run.dir={run_dir}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    out = resumed.stdout + resumed.stderr
    assert str(newest / damaged) in out and "iter_000000001, the newest complete checkpoint before it" in out, out
    assert "Traceback" not in resumed.stderr
    assert "Warning" not in resumed.stderr, resumed.stderr  # torch's about the damaged shards the re-save replaces
    assert_same_run(tmp_path / "whole", run_dir)


def test_the_only_checkpoint_damaged_is_one_line_without_delete_advice(tmp_path):
    args = [*ARGS, "checkpoint.keep=1", "checkpoint.every_iterations=2", f"run.dir={tmp_path}"]
    stopped = run_main(*args, "run.stop_after_iterations=4")
    assert stopped.returncode == 75, stopped.stderr[-3000:]
    (only,) = (tmp_path / "checkpoints").glob("iter_*")
    _flip_a_byte(only / "rank0.pt")
    resumed = run_main(*args)
    line = assert_one_line_exit_2(resumed, str(only / "rank0.pt"), "only complete checkpoint", max_chars=1000)
    assert "delete" not in line
    metrics = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(metrics) == 4  # the refusal cleared nothing


def test_a_latest_that_names_an_older_checkpoint_is_followed_with_a_note(tmp_path):
    # An edited pointer, or a save ended between its COMPLETE marker and the pointer: the resume takes what latest
    # names and says which newer complete checkpoint it passes over (fault pass 5, K3: it said nothing)
    store = CheckpointStore(tmp_path)
    for iteration in (3, 7):
        store.save({"w": [iteration]}, iteration, 0)
        store.commit(iteration)
    (tmp_path / "checkpoints" / "latest").write_text("iter_000000003\n")
    checkpoint, why = store.latest_sound_and_why()
    assert checkpoint == tmp_path / "checkpoints" / "iter_000000003"
    assert "names iter_000000003, but iter_000000007 is complete and newer: resuming from iter_000000003" in why
    (tmp_path / "checkpoints" / "latest").write_text("iter_000000007\n")
    assert store.latest_sound_and_why() == (tmp_path / "checkpoints" / "iter_000000007", "")
