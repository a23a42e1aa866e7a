"""The unclear lines, each now saying what happened and what to do: a file of pickled objects refused in our words
(not torch's advice to load it with weights_only=False); a config that is a device or a FIFO; an experience file
that is missing or empty on resume (refused as it is, never replaced); YAML integers in the 1.2 sense (064 is 64,
1:30 is no number) and a note when yes/no/on/off became a boolean."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from spmd_rl.config.loading import load_config
from spmd_rl.run.policies import read_trained_state
from spmd_rl.runtime.errors import USER_ERROR_EXIT_CODE, UserError

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "ci_tiny.yaml")


class _Payload:
    def __reduce__(self):
        return (print, ("payload ran",))


def test_a_file_of_pickled_objects_is_refused_without_torch_s_advice_to_unpickle_it(tmp_path):
    path = tmp_path / "policy.pt"
    torch.save({"weight": _Payload()}, path)
    with pytest.raises(UserError) as refused:
        read_trained_state(path)
    said = str(refused.value)
    assert "holds pickled Python objects (GLOBAL print) besides tensors" in said, said
    assert "weights_only" not in said and "\n" not in said, said


def test_a_config_that_is_a_device_or_a_fifo_is_not_called_missing(tmp_path):
    fifo = tmp_path / "config.fifo"
    os.mkfifo(fifo)
    for path in ("/dev/null", str(fifo)):
        with pytest.raises(UserError, match="is not a regular file \\(a device, FIFO or socket\\)"):
            load_config(path)


def test_yaml_integers_are_read_as_yaml_1_2_and_a_1_1_boolean_gets_a_note(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  total_steps: 064\n  deterministic: on\n")
    cfg = load_config(path)
    assert cfg.train.total_steps == 64  # YAML 1.1 (PyYAML) read 52: octal
    assert cfg.train.deterministic is True
    note = capsys.readouterr().err.strip()
    assert note == (
        f"spmd_rl: note: config file {path} line 3: 'on' is read as true (YAML 1.1's booleans yes/no/on/off); "
        "write true to say so, or quote it ('on') for the text"
    )
    with pytest.raises(UserError, match="'train.total_steps' must be int, got '1:30'"):  # 1.1 read 90: base 60
        load_config(None, ["train.total_steps=1:30"])
    assert load_config(None, ["train.total_steps=0x40"]).train.total_steps == 64  # hex stays


@pytest.mark.slow  # two runs each
@pytest.mark.parametrize("damage", ["deleted", "emptied"])
def test_a_missing_or_empty_experience_file_on_resume_is_refused_and_left_as_it_is(tmp_path, damage):
    run_dir = tmp_path / "run"
    env = dict(os.environ)
    env.pop("RANK", None)
    command = [
        sys.executable,
        "-m",
        "spmd_rl.main",
        "--config",
        TINY,
        "buffer.log_experience=true",
        f"run.dir={run_dir}",
    ]
    first = subprocess.run(
        [*command, "run.stop_after_iterations=2"], env=env, capture_output=True, text=True, timeout=180
    )
    assert first.returncode == 75, first.stderr[-2000:]
    path = run_dir / "buffer" / "experience_rank0.h5"
    if damage == "deleted":
        path.unlink()
    else:
        path.write_bytes(b"")
    resumed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=180)
    assert resumed.returncode == USER_ERROR_EXIT_CODE, resumed.stderr[-2000:]
    says = "is missing, but the checkpoint this run resumes from counts rows" if damage == "deleted" else "is empty"
    assert f"spmd_rl: error: {path} {says}" in resumed.stderr, resumed.stderr[-2000:]
    assert "restore it from a copy, or remove" in resumed.stderr
    assert (not path.exists()) if damage == "deleted" else path.stat().st_size == 0  # never replaced
