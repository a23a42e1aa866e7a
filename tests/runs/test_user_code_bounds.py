"""Bounds on user code from the first import on: a plug-in module whose import never finishes ends the command
(--help included) with one line within dist.timeout_s, and a first SIGTERM meanwhile is honoured at once; an
evaluation too large to finish is refused (eval.episodes has an upper bound); a tracker whose server never answers
is a line within dist.timeout_s, not minutes of retries."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spmd_rl.config.loading import load_config
from spmd_rl.runtime.errors import USER_CODE_EXIT_CODE, UserError

ROOT = Path(__file__).resolve().parents[2]
HANGING_MODULE = (
    "import os\nimport time\n\nopen(os.environ['IMPORT_STARTED'], 'w').close()\n"
    "time.sleep(600)  # a module waiting on a server that never answers\n"
)


def _command(tmp_path: Path, *args: str) -> tuple[list[str], dict]:
    (tmp_path / "hanging_plugin.py").write_text(HANGING_MODULE)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]))
    env["IMPORT_STARTED"] = str(tmp_path / "import_started")
    env.pop("RANK", None)
    return [sys.executable, "-m", "spmd_rl.main", *args], env


def test_a_plugin_import_that_never_finishes_ends_help_with_one_line_naming_it(tmp_path):
    command, env = _command(tmp_path, "--help", "policy.class=hanging_plugin:Net", "dist.timeout_s=2")
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == USER_CODE_EXIT_CODE, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"spmd_rl: importing module 'hanging_plugin' (policy.class) did not return within 2 s; stuck at "
        f"{tmp_path / 'hanging_plugin.py'}:5 (a hang, or slower than the bound: raise dist.timeout_s if it is only "
        "slow; SPMD_RL_DEBUG=1 prints every thread's stack)"
    ]


def test_a_first_sigterm_during_a_hanging_plugin_import_is_honoured_at_once(tmp_path):
    command, env = _command(tmp_path, "algo.class=hanging_plugin:Algo")
    process = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not (tmp_path / "import_started").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 128 + signal.SIGTERM, stderr
    assert (tmp_path / "import_started").exists()
    assert stderr.strip().splitlines() == [
        "spmd_rl: stopped by SIGTERM while starting (importing module 'hanging_plugin' (algo.class)), before the run "
        "began"
    ]


def test_eval_episodes_has_an_upper_bound():
    with pytest.raises(UserError, match="eval.episodes"):
        load_config(None, ["eval.episodes=1000000000"])


def test_an_mlflow_server_that_never_answers_is_a_line_within_dist_timeout_s(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from spmd_rl.run.trackers import open_trackers

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "60")  # the user's own wait per request: kept
    with socket.socket() as silent:  # accepts connections (the kernel's backlog) and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        uri = f"http://127.0.0.1:{silent.getsockname()[1]}"
        cfg = load_config(None, ["log.mlflow=true", f"log.mlflow_tracking_uri={uri}", "dist.timeout_s=2"])
        started = time.monotonic()
        with pytest.raises(UserError, match="'log.mlflow': the tracker did not start within dist.timeout_s=2 s"):
            open_trackers(cfg, tmp_path, resumed=False)
    assert time.monotonic() - started < 60


def test_mlflow_retries_of_a_refused_address_fit_in_dist_timeout_s(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from spmd_rl.run.trackers import open_trackers

    for name in (
        "MLFLOW_HTTP_REQUEST_MAX_RETRIES",
        "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR",
        "MLFLOW_HTTP_REQUEST_TIMEOUT",
    ):
        monkeypatch.delenv(name, raising=False)  # MLflow's defaults: 7 retries, ~4 min for a refused address
    cfg = load_config(None, ["log.mlflow=true", "log.mlflow_tracking_uri=http://127.0.0.1:9", "dist.timeout_s=20"])
    with pytest.raises(UserError, match=r"'log.mlflow': cannot start an MLflow run at http://127.0.0.1:9 \("):
        open_trackers(cfg, tmp_path, resumed=False)  # MLflow's own error, not the bound's
