"""log.wandb and log.mlflow: a tiny run with both on (W&B offline, MLflow in a file store under tmp_path) gets the
same scalars as metrics.jsonl at x = env_steps and the resolved config; a stop and a resume continue the same W&B
run and the same MLflow run; a missing package is one line naming the key and the extra."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from spmd_rl.config.loading import load_config
from spmd_rl.run.trackers import check_installed, require_package
from spmd_rl.runtime.errors import UserError

REPO = Path(__file__).resolve().parents[2]
STOPPED = 75


def test_a_missing_package_is_one_line_naming_the_key_and_the_extra():
    with pytest.raises(UserError) as raised:
        require_package("log.wandb", "spmd_rl_no_such_module", "wandb")
    assert str(raised.value) == (
        "config key 'log.wandb' = true needs the spmd_rl_no_such_module package: pip install -e \".[wandb]\""
    )
    require_package("log.mlflow", "json", "mlflow")  # found: nothing to say
    check_installed(load_config(None, ["log.wandb=false", "log.mlflow=false"]))  # off: nothing is looked up


def test_a_missing_package_stops_the_command_before_start(tmp_path):
    """The check runs where the other checks before start run: exit 2 and one line, no run directory."""
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(
        "import importlib.util\n"
        "_find = importlib.util.find_spec\n"
        "importlib.util.find_spec = lambda name, *a: None if name == 'mlflow' else _find(name, *a)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(shim)}
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "spmd_rl.main", "--config", "configs/ci_tiny.yaml", "log.mlflow=true"]
        + [f"run.dir={run_dir}"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert "config key 'log.mlflow' = true needs the mlflow package: pip install -e \".[mlflow]\"" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not run_dir.exists()


def _train(run_dir: Path, env: dict, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "spmd_rl.main", "--config", "configs/ci_tiny.yaml", f"run.dir={run_dir}", *overrides],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


def _wandb_records(path: Path):
    """The records of a W&B transaction log (.wandb: a 7-byte header, then LevelDB-style 32 KiB blocks of chunks
    with a 7-byte header each: crc32, length, type FULL=1 FIRST=2 MIDDLE=3 LAST=4), as protobuf Records."""
    from wandb.proto import wandb_internal_pb2

    data, block, position, pending = path.read_bytes(), 32768, 7, b""
    assert data[:4] == b":W&B"
    while position + 7 <= len(data):
        if block - position % block < 7:  # a block's tail too short for a header is padding
            position += block - position % block
            continue
        length, kind = int.from_bytes(data[position + 4 : position + 6], "little"), data[position + 6]
        pending += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):
            yield wandb_internal_pb2.Record.FromString(pending)
            pending = b""


def _wandb_segments(run_dir: Path) -> list[dict]:
    """Per offline W&B process (oldest first): its run id, history {step: {key: value}} and config."""
    segments = []
    for directory in sorted((run_dir / "wandb").glob("offline-run-*")):
        (log_file,) = directory.glob("run-*.wandb")
        segment = {"id": None, "history": {}, "config": {}}
        for record in _wandb_records(log_file):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                segment["id"] = record.run.run_id
            elif kind == "history":
                items = {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item
                }
                segment["history"][items["_step"]] = items
            elif kind == "config":
                for item in record.config.update:
                    segment["config"][item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
        segments.append(segment)
    return segments


@pytest.mark.slow
def test_wandb_and_mlflow_get_the_scalars_and_config_and_a_resume_continues_their_runs(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    uri = (tmp_path / "mlruns").as_uri()
    env = {key: value for key, value in os.environ.items() if not key.startswith(("WANDB_", "MLFLOW_"))}
    env.update(
        WANDB_SILENT="true",
        WANDB_CONFIG_DIR=str(tmp_path / "wandb_config"),
        WANDB_CACHE_DIR=str(tmp_path / "wandb_cache"),
        WANDB_DATA_DIR=str(tmp_path / "wandb_data"),
        MLFLOW_ALLOW_FILE_STORE="true",  # MLflow 3's file store (mlflow-skinny has no SQL backend)
    )
    run_dir = tmp_path / "run"
    overrides = ("log.wandb=true", "log.wandb_mode=offline", "log.mlflow=true", f"log.mlflow_tracking_uri={uri}")
    stopped = _train(run_dir, env, *overrides, "run.stop_after_iterations=3")
    assert stopped.returncode == STOPPED, stopped.stderr
    wandb_id, mlflow_id = (run_dir / "wandb_run_id").read_text(), (run_dir / "mlflow_run_id").read_text()
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=uri)
    assert client.get_run(mlflow_id.strip()).info.status == "KILLED"  # a stop: the run resumes later

    resumed = _train(run_dir, env, *overrides)
    assert resumed.returncode == 0, resumed.stderr
    assert (run_dir / "wandb_run_id").read_text() == wandb_id
    assert (run_dir / "mlflow_run_id").read_text() == mlflow_id

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == list(range(8))
    scalars = [key for key in records[0] if key not in ("iteration", "env_steps")]

    # W&B: two offline segments of the one run, stepping by env_steps; together they hold every record once.
    segments = _wandb_segments(run_dir)
    assert [s["id"] for s in segments] == [wandb_id.strip()] * 2
    history = {**segments[0]["history"], **segments[1]["history"]}
    assert sorted(segments[0]["history"]) == [r["env_steps"] for r in records[:3]]
    assert sorted(history) == [r["env_steps"] for r in records]
    for record in records:
        logged = history[record["env_steps"]]
        for key in scalars:
            if record[key] is None:  # no finished episode yet: nothing logged, as in TensorBoard
                assert key not in logged
            else:
                assert logged[key] == pytest.approx(record[key]), key
    config = segments[1]["config"]
    assert config["train"]["total_steps"] == 256 and config["log"]["wandb"] is True
    assert config["algo"]["class"] == "ppo"

    # MLflow: one run, finished, every scalar at every env_steps once, the config as params and as config.yaml.
    run = client.get_run(mlflow_id.strip())
    assert run.info.status == "FINISHED"
    assert len(client.search_runs([run.info.experiment_id])) == 1
    for key in ("episodes", "sps", "policy_loss", "wall_s"):
        history = client.get_metric_history(run.info.run_id, key)
        assert [(m.step, m.value) for m in sorted(history, key=lambda m: m.step)] == [
            (r["env_steps"], pytest.approx(r[key])) for r in records
        ], key
    assert run.data.params["train.total_steps"] == "256" and run.data.params["env.id"] == "CartPole-v1"
    artifact = Path(client.download_artifacts(run.info.run_id, "config.yaml", str(tmp_path / "artifacts")))
    assert "total_steps: 256" in artifact.read_text()
