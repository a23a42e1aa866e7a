"""A resume reads a checkpoint's `latest` pointer, COMPLETE marker and shard files' checksums boundedly: one that
is a FIFO was waited on forever (rank 0 opened it for reading, the job ended at the timeout with a knock-on and
exit 3, or 1 under launch/torchrun.sh) and one linked to /dev/zero was read until memory ran out (fault pass 6, D4,
D5). Each is now a pointer that cannot be read, a checkpoint that is not complete, a shard file that does not match:
the resume falls back with its note, or refuses in one line."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from spmd_rl.persist.checkpoint import CheckpointStore, _is_complete
from spmd_rl.persist.fileio import sha256_of


class Hung(BaseException):
    """Not an OSError (TimeoutError is one), which the readers take for a file that cannot be read."""


@pytest.fixture(autouse=True)
def bounded():
    """A read that blocks fails the test instead of hanging it."""

    def hung(*_):
        raise Hung("the read did not return within 20 s")

    before = signal.signal(signal.SIGALRM, hung)
    signal.alarm(20)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, before)


def _two_checkpoints(tmp_path):
    store = CheckpointStore(tmp_path, keep=2)
    for iteration in (3, 4):
        store.save({"x": torch.zeros(2)}, iteration, 0)
        store.commit(iteration, world_size=1)
    return store


@pytest.mark.parametrize("kind", ["fifo", "dev_zero"])
def test_a_latest_pointer_that_is_no_regular_file_is_passed_over_with_a_note(tmp_path, kind):
    store = _two_checkpoints(tmp_path)
    pointer = store.root / "latest"
    pointer.unlink()
    os.mkfifo(pointer) if kind == "fifo" else pointer.symlink_to("/dev/zero")
    checkpoint, why = store.latest_and_why()
    assert checkpoint == store.directory(4)
    assert "cannot be read" in why and "resuming from" in why


@pytest.mark.parametrize("kind", ["fifo", "dev_zero"])
def test_a_complete_marker_that_is_no_regular_file_marks_no_checkpoint_complete(tmp_path, kind):
    store = _two_checkpoints(tmp_path)
    marker = store.directory(4) / "COMPLETE"
    marker.unlink()
    os.mkfifo(marker) if kind == "fifo" else marker.symlink_to("/dev/zero")
    assert not _is_complete(store.directory(4))
    assert store.latest() == store.directory(3)


@pytest.mark.parametrize("kind", ["fifo", "dev_zero"])
def test_the_checksum_of_a_file_that_is_no_regular_file_is_empty(tmp_path, kind):
    path = tmp_path / "__0_0.distcp"
    os.mkfifo(path) if kind == "fifo" else path.symlink_to("/dev/zero")
    assert sha256_of(path) == ""


def _run_with_one_checkpoint(tmp_path):
    """A ci_tiny run directory whose only checkpoint is iteration 4's (keep 1): (config, run dir, store)."""
    from spmd_rl.config.loading import load_config

    run_dir = tmp_path / "run"
    cfg = load_config("configs/ci_tiny.yaml", [f"run.dir={run_dir}"])
    store = CheckpointStore(run_dir, keep=1)
    store.save({"x": torch.zeros(2)}, 4, 0)
    store.commit(4, world_size=1)
    (run_dir / "config.yaml").write_text(cfg.to_yaml())
    return cfg, run_dir, store


@pytest.mark.parametrize("marker", ["", '{"iteration": 4, "fi'])
def test_a_damaged_marker_of_the_only_checkpoint_refuses_the_resume_rather_than_clear_the_run(tmp_path, marker):
    # fault pass 7, D6: the only checkpoint's COMPLETE truncated to 0 bytes (its weights whole) made the resume take
    # the run for one "without a checkpoint": it cleared metrics.jsonl and the checkpoint and started over
    from spmd_rl.run.resume import decide_resume
    from spmd_rl.runtime.errors import UserError

    cfg, run_dir, store = _run_with_one_checkpoint(tmp_path)
    (run_dir / "metrics.jsonl").write_text('{"iteration": 0}\n')
    (store.directory(4) / "COMPLETE").write_text(marker)
    with pytest.raises(UserError, match=r"COMPLETE is damaged .*restore the file from a copy"):
        decide_resume(cfg, run_dir, world_size=1)
    # a save cut short (no marker at all) still starts over
    (store.directory(4) / "COMPLETE").unlink()
    assert decide_resume(cfg, run_dir, world_size=1).checkpoint is None


def test_a_latest_that_is_a_directory_is_refused_at_the_start(tmp_path):
    # fault pass 7, D5: `checkpoints/latest` a directory: the resume noted it, trained, and failed only at its first
    # checkpoint (a commit's rename never replaces a directory); now refused before anything runs, naming the path
    from spmd_rl.run.resume import decide_resume
    from spmd_rl.runtime.errors import UserError

    cfg, run_dir, store = _run_with_one_checkpoint(tmp_path)
    assert decide_resume(cfg, run_dir, world_size=1).checkpoint == store.directory(4)
    (store.root / "latest").unlink()
    (store.root / "latest").mkdir()
    with pytest.raises(UserError, match=r"checkpoints/latest is a directory, .*move it away .*left as it is"):
        decide_resume(cfg, run_dir, world_size=1)
    (store.root / "latest").rmdir()
    (store.root / "latest").symlink_to(store.directory(4))  # a link to a directory: a commit replaces it
    assert decide_resume(cfg, run_dir, world_size=1).checkpoint == store.directory(4)


def test_a_marker_copied_from_another_checkpoint_is_named_not_the_sound_files(tmp_path):
    # fault pass 8, D4: iter_5's COMPLETE replaced by iter_3's: the note blamed iter_5's intact rank0.pt ("truncated or
    # altered", by iter_3's recorded size) and sent the user to restore the wrong file
    from spmd_rl.persist.checkpoint import checkpoint_damage

    store = CheckpointStore(tmp_path / "run", keep=2)
    for iteration, size in ((3, 2), (5, 40)):
        store.save({"x": torch.zeros(size)}, iteration, 0)
        store.commit(iteration, world_size=1)
    assert checkpoint_damage(store.directory(5)) == ""
    (store.directory(5) / "COMPLETE").write_bytes((store.directory(3) / "COMPLETE").read_bytes())
    damage = checkpoint_damage(store.directory(5))
    assert damage.startswith(f"checkpoint marker {store.directory(5) / 'COMPLETE'} is of iteration 3"), damage


def test_a_rank_file_copied_from_another_checkpoint_is_named_and_passed_over(tmp_path):
    # fault pass 9, D2: iter_5's rank2.pt (an inference rank's: the same size at every iteration) replaced by iter_3's
    # whole, checksummed file resumed without a word, that rank's state two iterations old; D1: a trainer's was
    # blamed on its sound shard file
    from spmd_rl.persist.checkpoint import checkpoint_damage

    store = CheckpointStore(tmp_path / "run", keep=2)
    for iteration in (3, 5):
        for rank in (0, 1):
            store.save({"iteration": iteration, "x": torch.full((4,), float(iteration))}, iteration, rank)
        store.commit(iteration, world_size=2)
    assert checkpoint_damage(store.directory(5)) == ""
    (store.directory(5) / "rank1.pt").write_bytes((store.directory(3) / "rank1.pt").read_bytes())
    damage = checkpoint_damage(store.directory(5))
    assert damage.startswith(f"checkpoint file {store.directory(5) / 'rank1.pt'} holds the state of iteration 3"), (
        damage
    )
    checkpoint, why = store.latest_sound_and_why()
    assert checkpoint == store.directory(3) and "resuming from" in why, why


def test_when_every_checkpoint_is_damaged_the_line_names_the_newest_first(tmp_path):
    # fault pass 8, D10: with iter_5 and iter_3 both damaged the line named only iter_3's file and called it "the
    # run's only complete checkpoint"; restoring iter_5's file would lose nothing
    from spmd_rl.runtime.errors import UserError

    store = CheckpointStore(tmp_path / "run", keep=2)
    for iteration in (3, 5):
        store.save({"x": torch.zeros(4)}, iteration, 0)
        store.commit(iteration, world_size=1)
        with open(store.directory(iteration) / "rank0.pt", "ab") as file:
            file.write(b"x")  # its size no longer the marker's
    with pytest.raises(UserError) as refused:
        store.latest_sound_and_why()
    line = str(refused.value)
    assert line.startswith("every complete checkpoint of the run is damaged; the newest: checkpoint file "), line
    assert line.index("iter_000000005") < line.index("iter_000000003") and "only complete" not in line
