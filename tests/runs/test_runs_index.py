"""python -m spmd_rl.runs: every run directory under runs/ with its state, counters and last return, read from the
files runs write (run.lock's holder and exit code, finished.json,
metrics.jsonl, config.yaml), damaged ones included. The states come from real runs (the slow test) and from the
lock functions a run uses (the fast ones)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import pytest
import yaml

from spmd_rl.persist import run_lock
from spmd_rl.runs import find_runs, format_table, main, statuses

ROOT = Path(__file__).resolve().parents[2]


def fake_run(root: Path, name: str, ended: int | None, returns=(10.0, 20.0), learning_rate=0.001) -> Path:
    """A run directory as a run leaves it; ended: the exit code its holder recorded (None: killed, no record)."""
    run_dir = root / name
    run_dir.mkdir(parents=True)
    config = {
        "run": {"name": name.rsplit("-", 1)[0], "dir": str(run_dir)},
        "env": {"id": "CartPole-v1"},
        "algo": {"class": "ppo", "learning_rate": learning_rate},
        "train": {"seed": 1, "total_steps": 1000},
    }
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    records = [{"iteration": i, "env_steps": 100 * (i + 1), "episode_return_mean": r} for i, r in enumerate(returns)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    run_lock.lock_run_dir(run_dir)
    run_lock.own_run_dirs()  # as a run does at its first checkpoint: its end is recorded from then on
    run_lock.release_run_dirs(ended)
    return run_dir


def test_each_state_from_the_files_a_run_leaves(tmp_path):
    runs = tmp_path / "runs"
    finished = fake_run(runs, "ppo-aaaaaaaa", 0, returns=(10.0, 20.0, 30.0))
    (finished / "finished.json").write_text(json.dumps({"finished": True, "config_digest": "ab" * 32}) + "\n")
    fake_run(runs, "ppo-bbbbbbbb", 75)
    fake_run(runs, "ppo-cccccccc", 4, learning_rate=0.01)
    fake_run(runs, "ppo-dddddddd", None)
    running = fake_run(runs / "sweep", "ppo-eeeeeeee", 75)
    (runs / "new").mkdir()
    (runs / "new" / "config.yaml").write_text("run: {name: new}\n")
    run_lock.lock_run_dir(running)  # resumed: held now (an flock conflicts across open files, also in one process)
    try:
        rows = {Path(row.directory).relative_to(runs).as_posix(): row for row in statuses(find_runs([runs]))}
    finally:
        run_lock.release_run_dirs()
    assert {name: row.state for name, row in rows.items()} == {
        "new": "new",
        "ppo-aaaaaaaa": "finished",
        "ppo-bbbbbbbb": "stopped",
        "ppo-cccccccc": "failed",
        "ppo-dddddddd": "killed",
        "sweep/ppo-eeeeeeee": "running",
    }
    done = rows["ppo-aaaaaaaa"]
    assert (done.iterations, done.env_steps, done.total_steps, done.last_return) == (3, 300, 1000, 30.0)
    assert rows["ppo-cccccccc"].exit_code == 4
    assert "digest" not in asdict(done), "the directory name holds the digest; finished.json's may differ from it"
    assert rows["sweep/ppo-eeeeeeee"].holder == f"host {os.uname().nodename}, pid {os.getpid()}"
    table = format_table(list(rows.values()), runs, time.time()).splitlines()
    # the columns a user reads; the config keys that differ are spmd_rl.plot's labels, not a column of noise here
    assert table[0].split() == ["RUN", "STATE", "ITERS", "ENV", "STEPS", "RETURN", "EVAL", "UPDATED"]
    running_line = next(line for line in table if line.startswith("sweep/ppo-eeeeeeee"))
    assert f"running (host {os.uname().nodename}, pid {os.getpid()})" in running_line


def test_damaged_files_are_notes_not_tracebacks(tmp_path, capsys):
    runs = tmp_path / "runs"
    run_dir = fake_run(runs, "ppo-aaaaaaaa", 75, returns=(1.0, 2.0))
    with open(run_dir / "metrics.jsonl", "ab") as f:
        f.write(b"\xff\xfe not json\n")
        f.write(b'{"iteration": 2, "env_steps": 300, "episode_return_mean": 3.0}\n{"iteration": 3, "env_')
    (run_dir / "run.lock").write_bytes(b"\x00garbage")
    other = fake_run(runs, "ppo-bbbbbbbb", 0)
    (other / "config.yaml").write_text("run: [unclosed\n")
    (other / "finished.json").write_text("{torn")
    assert main([str(runs)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["RUN", "STATE", "ITERS"]
    first = lines[1].split()
    assert first[:6] == ["ppo-aaaaaaaa", "killed,", "damaged", "3", "300/1000", "3.00"]  # the sound records' last
    assert "metrics.jsonl: 2 line(s) that are no JSON record skipped" in out
    assert "config.yaml does not load" in out
    assert lines[2].split()[:3] == ["ppo-bbbbbbbb", "finished,", "damaged"]  # run.lock recorded exit 0
    assert f"{other / 'finished.json'} is no JSON record" in out


def test_json_lines_and_a_missing_directory(tmp_path, capsys):
    fake_run(tmp_path / "runs", "ppo-aaaaaaaa", 75)
    assert main([str(tmp_path / "runs"), "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert (row["state"], row["exit_code"], row["iterations"]) == ("stopped", 75, 2)
    assert main([str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nowhere does not exist" in err
    # given the run directory itself, the RUN column names it, not "." (pass 4, L2)
    assert main([str(tmp_path / "runs" / "ppo-aaaaaaaa")]) == 0
    (row,) = capsys.readouterr().out.splitlines()[1:]
    assert row.split()[0] == str(tmp_path / "runs" / "ppo-aaaaaaaa"), row
    # a FIFO given as the directory of runs: named for what it is, not "no runs under" it (fault pass 6, RL)
    os.mkfifo(tmp_path / "fifo")
    assert main([str(tmp_path / "fifo")]) == 2
    assert (
        capsys.readouterr().err
        == f"error: {tmp_path / 'fifo'} is a FIFO: give a directory holding runs (runs/, a sweep's)\n"
    )


FAILING_ENV = """
from gymnasium.envs.classic_control.cartpole import CartPoleEnv


class Failing(CartPoleEnv):
    steps = 0

    def step(self, action):
        self.steps += 1
        if self.steps > 40:
            raise ValueError("deliberate failure")
        return super().step(action)


def make():
    return Failing()
"""


@pytest.mark.slow
def test_real_runs_finished_stopped_and_failed(tmp_path):
    """Real runs of `python -m spmd_rl.main`, one process each, in one runs/ directory."""
    (tmp_path / "failing_env.py").write_text(FAILING_ENV)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{tmp_path}", "OMP_NUM_THREADS": "1"}
    base = [sys.executable, "-m", "spmd_rl.main", "--config", str(ROOT / "configs" / "ci_tiny.yaml")]
    cases = {
        "finished": (["run.name=done"], 0),
        "stopped": (["run.name=stopped", "run.stop_after_iterations=2"], 75),
        "failed": (
            ["run.name=failed", "env.id=failing_env:make"],
            4,
        ),
    }
    for overrides, code in cases.values():
        done = subprocess.run([*base, *overrides], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == code, done.stderr
    listing = subprocess.run(
        [sys.executable, "-m", "spmd_rl.runs"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )
    assert listing.returncode == 0, listing.stderr
    states = {line.split()[0].split("-")[0]: line.split()[1:4] for line in listing.stdout.splitlines()[1:]}
    assert states["done"][0] == "finished" and states["done"][2] == "256/256"
    assert states["stopped"][:3] == ["stopped", "(75)", "2"]
    assert states["failed"][:2] == ["failed", "(4)"]
    assert "torch" not in subprocess.run(
        [sys.executable, "-c", "import sys, spmd_rl.runs; print(sorted(sys.modules))"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout.split("'")  # answers at once


NESTED = b"[" * 100_000 + b"]" * 100_000  # json.loads recurses once per bracket: a RecursionError, not a ValueError
ALIAS_BOMB = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 10)}]\n" for i in range(9)
)  # 10^10 values once the aliases are expanded


def _list(runs: Path) -> subprocess.CompletedProcess:
    """python -m spmd_rl.runs in a process of its own: a hang fails the test (timeout) instead of stopping it."""
    command = [sys.executable, "-m", "spmd_rl.runs", str(runs)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(
    "damage, note",
    [
        ("nested metrics line", "metrics.jsonl: 1 line(s) that are no JSON record skipped"),
        ("metrics FIFO", "metrics.jsonl is not a regular file (a FIFO)"),
        ("metrics linked to /dev/zero", "metrics.jsonl is not a regular file (a character device)"),
        ("metrics of 2 GiB without a newline", "metrics.jsonl: 1 line(s) that are no JSON record skipped"),
        ("config alias bomb", "config.yaml does not load"),
        ("config FIFO", "config.yaml is not a regular file (a FIFO): its keys are not compared"),
        ("run.lock torn in half", "run.lock holds no whole note (torn or overwritten)"),
        # a resume of these steps back or is refused (fault pass 4, I5r: the index said only "stopped (75)")
        ("checkpoint truncated", "rank0.pt is truncated or altered (50 bytes, 100 when saved): a resume steps back"),
        ("checkpoint file missing", "iter_000000001/rank0.pt is missing: a resume steps back"),
        ("checkpoint marker FIFO", "iter_000000001/COMPLETE cannot be read"),
        # sharded trainers' files are not in the marker: DCP's index of them (fault pass 5, E2r)
        ("shards without their .metadata", "iter_000000001/shards/.metadata is missing: a resume of the sharded"),
    ],
)
def test_a_damaged_run_is_listed_as_damaged_without_hanging_or_a_traceback(tmp_path, damage, note):
    runs = tmp_path / "runs"
    run_dir = fake_run(runs, "ppo-aaaaaaaa", 75)
    for run in (run_dir, fake_run(runs, "ppo-bbbbbbbb", 75)):  # each with a committed checkpoint and a newer save
        committed, interrupted = run / "checkpoints" / "iter_000000001", run / "checkpoints" / "iter_000000002"
        for directory in (committed, interrupted):  # the interrupted one has no marker: a resume never loads it
            directory.mkdir(parents=True)
            (directory / "rank0.pt").write_bytes(b"x" * 100)
        (committed / "COMPLETE").write_text(json.dumps({"iteration": 1, "files": {"rank0.pt": 100}}) + "\n")
    checkpoint = run_dir / "checkpoints" / "iter_000000001"
    metrics, config = run_dir / "metrics.jsonl", run_dir / "config.yaml"
    if damage == "nested metrics line":
        metrics.write_bytes(metrics.read_bytes() + NESTED + b"\n" + b'{"iteration": 2, "env_steps": 300}\n')
    elif damage == "metrics FIFO":
        metrics.unlink()
        os.mkfifo(metrics)
    elif damage == "metrics linked to /dev/zero":
        metrics.unlink()
        metrics.symlink_to("/dev/zero")
    elif damage == "metrics of 2 GiB without a newline":
        with open(metrics, "ab") as file:
            file.truncate(2 << 30)  # sparse: zeros that take no disk
    elif damage == "config alias bomb":
        config.write_text(ALIAS_BOMB)
    elif damage == "checkpoint truncated":
        (checkpoint / "rank0.pt").write_bytes(b"x" * 50)
    elif damage == "checkpoint file missing":
        (checkpoint / "rank0.pt").unlink()
    elif damage == "checkpoint marker FIFO":
        (checkpoint / "COMPLETE").unlink()
        os.mkfifo(checkpoint / "COMPLETE")
    elif damage == "shards without their .metadata":
        (checkpoint / "shards").mkdir()
        (checkpoint / "shards" / "__0_0.distcp").write_bytes(b"x" * 100)
    elif damage == "run.lock torn in half":
        whole = (run_dir / "run.lock").read_bytes()
        (run_dir / "run.lock").write_bytes(whole[: len(whole) // 2])
    else:
        config.unlink()
        os.mkfifo(config)
    listing = _list(runs)
    assert listing.returncode == 0 and "Traceback" not in listing.stderr, listing.stderr[-2000:]
    lines = listing.stdout.splitlines()
    assert lines[1].startswith("ppo-aaaaaaaa") and ", damaged" in lines[1], listing.stdout
    assert lines[2].split()[:3] == ["ppo-bbbbbbbb", "stopped", "(75)"], listing.stdout  # the other run, as it is
    assert any(line.startswith("note: ") and note in line for line in lines), listing.stdout
