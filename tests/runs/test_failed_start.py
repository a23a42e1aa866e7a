"""A failed start changes nothing: a resume that is refused, or fails before its first new checkpoint, leaves the run
directory's files byte for byte as they were (config.yaml, run.lock's note of how the run ended, the checkpoints,
metrics.jsonl, TensorBoard's event files: none cut back, none added), so that `python -m spmd_rl.runs` still shows the
run as it was left; a resume killed (kill -9) before its first checkpoint changes run.lock's note alone; a resume that
gets as far as a checkpoint of its own records its config and its end as always."""

import json
import os
import re
import selectors
import signal
import subprocess
import sys
import time

import pytest
import torch
from harness.launch import ROOT, command, job_env
from harness.runs import TINY, run_main

from spmd_rl.persist.fileio import torch_save_atomic


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


@pytest.mark.parametrize("damage", [b"run: {name: [\xff\xfe", b"# nothing\n"], ids=["not-utf8", "empty"])
def test_a_resume_from_a_damaged_config_yaml_says_to_restore_it_and_changes_nothing(stopped_run, damage):
    (stopped_run / "config.yaml").write_bytes(damage)
    before = _files(stopped_run)
    refused = run_main("--config", TINY, f"run.dir={stopped_run}")
    assert refused.returncode == 2, refused.stderr
    (line,) = refused.stderr.strip().splitlines()
    assert f"cannot resume from {stopped_run}: its config.yaml does not load" in line, line
    # the advice for a --config file ("pass --config", "leave out --config") does not repair a run's own (pass 4, I4)
    assert "--config" not in line and "restore it from a copy" in line, line
    assert _files(stopped_run) == before


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
        # bounds MLflow's retries (258 s unbounded), and also the checks before start: 4 s ran out in them at CI's load
        "dist.timeout_s=15",
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


# A run of 1000 iterations stopped after 3 with TensorBoard on, checkpointed after iterations 1 and 2; the checkpoint of
# iteration 2 is then gone, so a resume continues from iteration 1 while metrics.jsonl and the event file hold
# iteration 2: what a resume rewrites when it commits its first checkpoint of its own, and not before.
EVENTS = ["--config", TINY, "log.tensorboard=true", "train.total_steps=32000"]


@pytest.fixture
def run_past_its_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    first = run_main(*EVENTS, f"run.dir={run_dir}", "checkpoint.every_iterations=2", "run.stop_after_iterations=3")
    assert first.returncode == 75, first.stderr
    checkpoints = run_dir / "checkpoints"
    for path in sorted((checkpoints / "iter_000000002").iterdir()):
        path.unlink()
    (checkpoints / "iter_000000002").rmdir()
    (checkpoints / "latest").write_text("iter_000000001\n")
    assert [json.loads(line)["iteration"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2]
    return run_dir


def _alter_a_moment(checkpoint) -> None:
    """Adam's first moment of the checkpoint's first optimizer parameter, one row shorter than that parameter: what
    a checkpoint of another version of the algorithm could hold (its config is this run's). The file's checksum and
    the COMPLETE marker's size are written anew, so only the shape is wrong."""
    path = checkpoint / "rank0.pt"
    state = torch.load(path, weights_only=True)
    moments = state["trainer"]["algorithm"]["optimizer"]["state"][0]
    moments["exp_avg"] = moments["exp_avg"][:, 1:].clone()
    torch_save_atomic(state, path)
    marker = json.loads((checkpoint / "COMPLETE").read_text())
    marker["files"]["rank0.pt"] = path.stat().st_size
    (checkpoint / "COMPLETE").write_text(json.dumps(marker) + "\n")


def test_a_checkpoint_whose_optimizer_state_does_not_fit_is_one_line_and_changes_nothing(run_past_its_checkpoint):
    run_dir = run_past_its_checkpoint
    checkpoint = run_dir / "checkpoints" / "iter_000000001"
    _alter_a_moment(checkpoint)
    shape = tuple(
        torch.load(checkpoint / "rank0.pt", weights_only=True)["trainer"]["algorithm"]["optimizer"]["state"][0][
            "exp_avg"
        ].shape
    )
    before = _files(run_dir)
    refused = run_main(*EVENTS, f"run.dir={run_dir}")
    assert refused.returncode == 2, refused.stdout[-2000:] + refused.stderr[-3000:]
    errors = [line for line in refused.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and "Traceback" not in refused.stderr, refused.stderr
    assert f"algorithm.optimizer.state.0.exp_avg {shape}" in errors[0], errors[0]
    assert _files(run_dir) == before


def test_a_resume_killed_before_its_first_checkpoint_changes_run_lock_alone(run_past_its_checkpoint):
    """kill -9 of a resume that logged iterations (its console lines say so) but committed no checkpoint: every
    file but run.lock as it was, no file added (no event file); run.lock names the killed start without an exit
    code. A resume after it then logs each iteration once, in metrics.jsonl and TensorBoard."""
    run_dir = run_past_its_checkpoint
    before = _files(run_dir)
    args = [*EVENTS, f"run.dir={run_dir}", "log.interval_s=0"]
    resume = subprocess.Popen(
        command("none") + args,
        cwd=ROOT,
        env=job_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    seen = _wait_for_line(resume, re.compile(r"^iter\s+4\b"), timeout=180)
    os.killpg(resume.pid, signal.SIGKILL)
    resume.wait(timeout=30)
    assert seen, "the resume never logged iteration 4"
    after = _files(run_dir)
    lock = after.pop("run.lock")
    assert after == {name: data for name, data in before.items() if name != "run.lock"}
    note = json.loads(lock)
    assert note["pid"] == resume.pid and "exit_code" not in note

    again = run_main(*args, "run.stop_after_iterations=6")
    assert again.returncode == 75, again.stderr
    iterations = [json.loads(line)["iteration"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert iterations == list(range(6))
    assert len(list((run_dir / "tensorboard").glob("events.out.tfevents.*"))) == 2


def _wait_for_line(process: subprocess.Popen, pattern: re.Pattern, timeout: float) -> bool:
    """Read the process's stdout until a line matches pattern (True), it ends or timeout seconds pass (False)."""
    assert process.stdout is not None
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            if not selector.select(timeout=1.0):
                continue
            line = process.stdout.readline()
            if not line:
                return False
            if pattern.search(line):
                return True
    return False


def test_a_damaged_finished_json_is_named_and_the_resume_refused_changing_nothing(stopped_run, tmp_path):
    """R4 (fault pass 7): a finished.json that is no JSON in a stopped run was taken for a finished run: the index
    said "finished" and the resume "holds a finished run", naming no file. A run writes it whole, so it is damage."""
    (stopped_run / "finished.json").write_text('{"bad\n')
    before = _files(stopped_run)
    refused = run_main("--config", TINY, f"run.dir={stopped_run}")
    assert refused.returncode == 2, refused.stderr
    (line,) = refused.stderr.strip().splitlines()
    assert f"{stopped_run / 'finished.json'} is no JSON record" in line
    assert "remove the file and rerun to resume" in line and "holds a finished run" not in line
    assert _files(stopped_run) == before
    index = subprocess.run(
        [sys.executable, "-m", "spmd_rl.runs", "--json", str(tmp_path)], capture_output=True, text=True, cwd=ROOT
    )
    row = json.loads(index.stdout.splitlines()[0])
    assert row["state"] == "stopped" and any("finished.json is no JSON record" in note for note in row["notes"])
