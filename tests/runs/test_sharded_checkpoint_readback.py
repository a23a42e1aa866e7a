"""A sharded checkpoint (train.parallel=fsdp) read back whole in one process: `python -m spmd_rl.evaluate` and
`run.init_from` gather its DCP shard files without a process group and give the same policy as the run's policy.pt;
`eval.every` evaluates during an fsdp run; a sharded checkpoint of another shape is one line naming the tensor."""

from __future__ import annotations

import math
import subprocess
from pathlib import Path

import pytest
import torch
from harness.launch import PYTHON, ROOT, job_env
from harness.runs import TINY, assert_one_line_exit_2, read_metrics, records_without_timings, run_main

from spmd_rl.evaluate import load_policy
from spmd_rl.persist.checkpoint import CheckpointStore

ARGS = ["--config", TINY, "train.seed=4", "log.progress=false", "log.tensorboard=false"]


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("sharded") / "run"
    result = run_main(*ARGS, "train.parallel=fsdp", f"run.dir={run_dir}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert list(run_dir.glob("checkpoints/iter_*/shards/*.distcp"))
    return run_dir


def run_module(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([PYTHON, "-m", *args], cwd=ROOT, env=job_env(), capture_output=True, text=True, timeout=240)


def _checkpoint(run_dir: Path) -> Path:
    latest = CheckpointStore(run_dir).latest()
    assert latest is not None
    return latest


def test_evaluate_reads_a_sharded_checkpoint_whole(sharded_run):
    """The last checkpoint's shards, gathered offline, are the weights of the run's policy.pt."""
    checkpoint = _checkpoint(sharded_run)
    from_shards, _ = load_policy(checkpoint)
    from_file, _ = load_policy(sharded_run / "policy.pt")
    a, b = from_shards.state_dict(), from_file.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    result = run_module("spmd_rl.evaluate", str(checkpoint), "--episodes", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "return" in result.stdout and "Traceback" not in result.stderr


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_init_from_a_sharded_checkpoint_starts_from_its_weights(sharded_run, tmp_path, parallel):
    """run.init_from of the sharded checkpoint starts the same run as run.init_from of the policy.pt written from
    the same weights: the same metrics and the same final weights."""
    short = [*ARGS, f"train.parallel={parallel}", "train.total_steps=64"]
    for name, source in (("shards", _checkpoint(sharded_run)), ("file", sharded_run / "policy.pt")):
        result = run_main(*short, f"run.init_from={source}", f"run.dir={tmp_path / name}")
        assert result.returncode == 0, result.stderr[-3000:]
    assert records_without_timings(tmp_path / "shards") == records_without_timings(tmp_path / "file")
    a, b = (torch.load(tmp_path / name / "policy.pt", weights_only=True) for name in ("shards", "file"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_init_from_a_sharded_checkpoint_of_another_shape_is_one_line(sharded_run, tmp_path):
    result = run_main(
        *ARGS,
        "policy.hidden_sizes=[32,32]",
        f"run.init_from={_checkpoint(sharded_run)}",
        f"run.dir={tmp_path / 'r'}",
    )
    assert_one_line_exit_2(result, "run.init_from=", "shape mismatch", "actor_and_critic.weight_0")


def test_eval_every_evaluates_during_an_fsdp_run(tmp_path):
    result = run_main(*ARGS, "train.parallel=fsdp", "eval.every=4", "eval.episodes=2", f"run.dir={tmp_path}")
    assert result.returncode == 0, result.stderr[-3000:]
    evaluated = [r for r in read_metrics(tmp_path) if "eval_return_mean" in r]
    assert [r["iteration"] for r in evaluated] == [3, 7]
    assert all(math.isfinite(r["eval_return_mean"]) and r["eval_return_mean"] > 0 for r in evaluated)
