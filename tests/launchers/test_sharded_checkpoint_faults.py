"""Damaged or mismatched sharded checkpoints (train.parallel=fsdp, 2 colocated ranks) are one line and exit 2 on
every rank: a shard file only rank 1 reads is refused by rank 1 and the refusal is agreed before the sharded load
(no peer left in a collective), and a checkpoint of another shape names the tensor before anything is loaded."""

from __future__ import annotations

import shutil
from pathlib import Path

from harness.runs import assert_one_line_exit_2, run_main

from spmd_rl.persist.checkpoint import CheckpointStore

ARGS = [
    "--config",
    "configs/ci_tiny.yaml",
    "train.seed=5",
    "train.parallel=fsdp",
    "log.progress=false",
    "log.tensorboard=false",
]


def _stopped_run(run_dir: Path, *extra: str) -> Path:
    result = run_main(*ARGS, *extra, f"run.dir={run_dir}", "run.stop_after_iterations=2", nproc=2)
    assert result.returncode == 75, result.stdout[-2000:] + result.stderr[-3000:]
    latest = CheckpointStore(run_dir).latest()
    assert latest is not None
    return latest


def _flip_a_byte(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    file.write_bytes(bytes(data))


def test_a_shard_file_one_rank_refuses_is_every_ranks_one_line(tmp_path):
    checkpoint = _stopped_run(tmp_path / "run")
    (shard,) = checkpoint.glob("shards/__1_*.distcp")  # written, and on resume checked, by rank 1 alone
    _flip_a_byte(shard)
    # run.resume names the checkpoint: rank 0 does not look for an older one; rank 1 finds the damage.
    resumed = run_main(*ARGS, f"run.dir={tmp_path / 'run'}", f"run.resume={checkpoint}", nproc=2)
    line = assert_one_line_exit_2(resumed, "rank 1", str(shard), "damaged", max_chars=1000)
    assert "gloo" not in resumed.stderr.lower() and "Connection closed" not in resumed.stderr, resumed.stderr
    assert "only complete checkpoint" in line  # checkpoint.keep: 2, but the first save is the only one yet


def test_a_checkpoint_of_another_shape_is_one_line_naming_the_tensor(tmp_path):
    wide = _stopped_run(tmp_path / "wide", "policy.hidden_sizes=[64,64]")
    narrow_dir = tmp_path / "narrow"
    _stopped_run(narrow_dir, "policy.hidden_sizes=[32,32]")
    shutil.rmtree(narrow_dir / "checkpoints")
    shutil.copytree(wide.parent, narrow_dir / "checkpoints")  # another run's checkpoints, copied in
    resumed = run_main(*ARGS, "policy.hidden_sizes=[32,32]", f"run.dir={narrow_dir}", nproc=2)
    assert_one_line_exit_2(resumed, "shape mismatch", "actor_and_critic.weight_0", max_chars=1000)
    assert "size mismatch" not in resumed.stderr
