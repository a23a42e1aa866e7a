"""Errors where they belong: an override's typo is blamed on the override (command line or the Python API's dict),
a file's on the file; an env object given to spmd_rl.train says what to give instead; the plan line says when
train.total_steps was rounded down; MLflow's failures are whole and advise by URI scheme."""

import re
import subprocess
import sys

import gymnasium as gym
import pytest
from harness.launch import ROOT
from harness.launch import job_env as _env
from harness.runs import TINY

import spmd_rl
from spmd_rl.config.loading import load_config
from spmd_rl.runtime.errors import UserError


def test_an_override_typo_with_a_config_file_names_the_override(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "spmd_rl.main", "--config", TINY, "train.totl_steps=5"],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "spmd_rl: error: unknown config key 'train.totl_steps' (in the override 'train.totl_steps=5'); did you "
        "mean 'train.total_steps'?"
    ]
    typo_in_file = tmp_path / "typo.yaml"
    typo_in_file.write_text("train:\n  totl_steps: 5\n")
    with pytest.raises(UserError, match=rf"'train.totl_steps' \(in {typo_in_file}\)"):
        load_config(typo_in_file, ["train.total_steps=64"])
    with pytest.raises(UserError, match=r"'algo.num_stps' \(in the override 'algo.num_stps=4'; keys of algorithm"):
        load_config(TINY, ["algo.num_stps=4"])


def test_the_python_api_blames_its_overrides_and_refuses_an_env_object_with_what_to_give():
    with pytest.raises(UserError, match=r"'train.totl_steps' \(in the override 'train.totl_steps=64'\)"):
        spmd_rl.train(TINY, {"train.totl_steps": 64})
    env = gym.make("CartPole-v1")
    with pytest.raises(UserError, match=r"^env.id: got a gymnasium Env object, .* give a registered id"):
        spmd_rl.train(TINY, {"env.id": env})
    with pytest.raises(UserError, match=r"^env.id: got a callable \(make_env\), .*'my_module:make_env'"):

        def make_env():
            return gym.make("CartPole-v1")

        spmd_rl.train(TINY, {"env.id": make_env})
    with pytest.raises(UserError, match=r"^train.seed: object .* is not a config value"):
        spmd_rl.train(TINY, {"train.seed": object()})


def test_the_plan_line_says_when_total_steps_is_rounded_down():
    from spmd_rl.run import contract
    from spmd_rl.run.plan import plan_run
    from spmd_rl.run.topology import build_topology

    for total, rounded in ((100, True), (96, False)):
        cfg = load_config(TINY, [f"train.total_steps={total}"])
        algorithm_cls = contract.load_classes(cfg)[1]
        plan = plan_run(cfg, build_topology(cfg.layout, 1), algorithm_cls)
        line = plan.describe(cfg, 1, "colocated", algorithm_cls)
        assert "3 iterations = 96 env steps" in line
        assert ("(train.total_steps=100 rounded down to whole iterations)" in line) is rounded


def test_mlflow_failures_are_whole_and_advise_by_uri_scheme(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from spmd_rl.run.trackers import MlflowSink

    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    advice = {
        f"file:{tmp_path / 'mlruns'}": "MLflow 3 opens a file store only with MLFLOW_ALLOW_FILE_STORE=true",
        "": "a database store needs the full MLflow (pip install mlflow",  # the default: sqlite:///mlflow.db
    }
    for uri, expected in advice.items():
        cfg = load_config(None, ["log.mlflow=true", f"log.mlflow_tracking_uri={uri}"])
        with pytest.raises(UserError) as raised:
            MlflowSink(cfg, tmp_path, resumed=False)
        message = str(raised.value)
        assert expected in message, message
        assert "(MLflow's default)" in message if not uri else uri in message
        mlflow_part = re.search(r"Exception: (.*)\); " + re.escape(expected), message).group(1)
        assert mlflow_part.endswith("."), f"MLflow's message is cut: {mlflow_part}"
