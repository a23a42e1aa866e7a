"""A failed start changes nothing: a resume that is refused, or fails before its first new checkpoint, leaves the run
directory's files byte for byte as they were (config.yaml, run.lock's note of how the run ended, the checkpoints,
metrics.jsonl), so that `python -m spmd_rl.runs` still shows the run as it was left; a resume that gets as far as a
checkpoint of its own records its config and its end as always."""

import json
import subprocess
import sys

import pytest
from harness.launch import ROOT
from harness.runs import TINY, run_main


def _files(run_dir) -> dict[str, bytes]:
    return {str(path.relative_to(run_dir)): path.read_bytes() for path in sorted(run_dir.rglob("*")) if path.is_file()}


def _state(tmp_path) -> str:
    index = subprocess.run(
        [sys.executable, "-m", "spmd_rl.runs", "--json", str(tmp_path)], capture_output=True, text=True, cwd=ROOT
    )
    assert index.returncode == 0, index.stderr
    return json.loads(index.stdout.splitlines()[0])["state"]


@pytest.fixture
def stopped_run(tmp_path):
    run_dir = tmp_path / "run"
    first = run_main("--config", TINY, f"run.dir={run_dir}", "run.stop_after_iterations=2")
    assert first.returncode == 75, first.stderr
    assert _state(tmp_path) == "stopped"
    return run_dir


def test_a_refused_resume_leaves_every_file_as_it_was(stopped_run, tmp_path):
    before = _files(stopped_run)
    refused = run_main("--config", TINY, f"run.dir={stopped_run}", "algo.update_epochs=3")
    assert refused.returncode == 2, refused.stderr
    assert "holds a run with a different config" in refused.stderr
    assert _files(stopped_run) == before
    assert _state(tmp_path) == "stopped"


@pytest.mark.skipif(
    subprocess.run([sys.executable, "-c", "import mlflow"], capture_output=True).returncode != 0,
    reason="needs the mlflow extra",
)
def test_a_resume_that_fails_before_its_first_checkpoint_leaves_every_file_as_it_was(stopped_run, tmp_path):
    before = _files(stopped_run)
    # log keys may change on resume; an MLflow server at a refused address fails the start after the agreement
    failed = run_main(
        "--config",
        TINY,
        f"run.dir={stopped_run}",
        "log.mlflow=true",
        "log.mlflow_tracking_uri=http://127.0.0.1:9",
        "dist.timeout_s=4",
    )
    assert failed.returncode == 2, failed.stderr
    assert "'log.mlflow'" in failed.stderr
    assert _files(stopped_run) == before
    assert _state(tmp_path) == "stopped"


def test_a_resume_that_checkpoints_records_its_config_and_its_end(stopped_run, tmp_path):
    resumed = run_main("--config", TINY, f"run.dir={stopped_run}", "run.stop_after_iterations=4")
    assert resumed.returncode == 75, resumed.stderr
    assert "stop_after_iterations: 4" in (stopped_run / "config.yaml").read_text()
    note = json.loads((stopped_run / "run.lock").read_text())
    assert note["exit_code"] == 75
    assert _state(tmp_path) == "stopped"
