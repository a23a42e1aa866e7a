"""Rerunning the same command resumes, under every launcher: the default run directory is the command's own
(runs/<run.name>-<config digest>, then -2, -3 for later runs of that config), and a signal stop ends the launcher
scripts with 75 and the stop line, without torchrun's traceback."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spmd_rl.run.resume import FINISHED, command_run_dir

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "ci_tiny.yaml")
# A resume writes its metrics records once its first checkpoint commits (a start that fails before changes no file:
# docs/storage-and-resume.md): a checkpoint every 20 iterations lets the resumed job's first record come within
# seconds, as the first job's does, instead of after checkpoint.every_s.
ENDLESS = ("--config", TINY, "train.total_steps=100000000", "log.tensorboard=false", "checkpoint.every_iterations=20")


def test_a_command_continues_its_newest_unfinished_run_and_starts_the_next_after_a_finished_one(tmp_path):
    assert command_run_dir(tmp_path, "ppo-0a1b2c3d", new=False) == (
        str(tmp_path / "ppo-0a1b2c3d"),
        "new: rerunning this command resumes it; run.resume=never starts another",
    )
    (tmp_path / "ppo-0a1b2c3d").mkdir()
    assert command_run_dir(tmp_path, "ppo-0a1b2c3d", new=False)[0] == str(tmp_path / "ppo-0a1b2c3d")
    assert command_run_dir(tmp_path, "ppo-0a1b2c3d", new=True) == (
        str(tmp_path / "ppo-0a1b2c3d-2"),
        "new: run.resume=never",
    )
    (tmp_path / "ppo-0a1b2c3d" / FINISHED).write_text('{"finished": true}')
    (tmp_path / "ppo-0a1b2c3d-other").mkdir()  # another run name that shares the prefix is not one of them
    (tmp_path / "ppo-0a1b2c3d-9").write_text("a file, not a run")
    directory, note = command_run_dir(tmp_path, "ppo-0a1b2c3d", new=False)
    assert directory == str(tmp_path / "ppo-0a1b2c3d-2") and "holds a finished run of this config" in note
    (tmp_path / "ppo-0a1b2c3d-2").mkdir()
    assert command_run_dir(tmp_path, "ppo-0a1b2c3d", new=False)[0] == str(tmp_path / "ppo-0a1b2c3d-2")


def _env(**extra) -> dict[str, str]:
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1", PYTHON=sys.executable, **extra)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def run_dirs(cwd: Path) -> list[str]:
    return sorted(p.name for p in (cwd / "runs").iterdir()) if (cwd / "runs").exists() else []


def test_rerunning_the_same_one_process_command_resumes_then_a_finished_run_is_followed_by_a_new_one(tmp_path):
    command = [sys.executable, "-m", "spmd_rl.main", "--config", TINY, "run.stop_after_iterations=2"]

    def run():
        return subprocess.run(command, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=120)

    stopped = run()
    assert stopped.returncode == 75 and "rerun the same command to resume" in stopped.stderr, stopped.stderr
    (first,) = run_dirs(tmp_path)
    assert first.startswith("ci_tiny-") and "rerunning this command resumes it" in stopped.stdout
    resumed = run()
    assert resumed.returncode == 0 and f"runs/{first} (this command's unfinished run); resuming from" in resumed.stdout
    again = run()
    assert again.returncode == 75 and f"runs/{first}-2 (new: runs/{first} holds a finished run" in again.stdout
    assert run_dirs(tmp_path) == [first, f"{first}-2"]


def _stop_with(command: list[str], cwd: Path, sig: signal.Signals, env: dict[str, str], group: bool = False):
    """Start a launcher script, wait for its first metrics record, send it `sig` (with group: to its whole process
    group, as `timeout`, a terminal's Ctrl-C or Slurm do); (exit code, stdout, stderr)."""
    job = subprocess.Popen(
        command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 120
        while not any(p.stat().st_size for p in cwd.glob("runs/*/metrics.jsonl")):
            assert job.poll() is None and time.monotonic() < deadline, job.communicate(timeout=5)
            time.sleep(0.2)
        if group:
            os.killpg(job.pid, sig)
        else:
            job.send_signal(sig)
        out, err = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.communicate()
    for metrics in cwd.glob("runs/*/metrics.jsonl"):
        metrics.unlink()  # the next start waits for its own first record
    return job.returncode, out, err


LAUNCHERS = [
    pytest.param(["launch/torchrun.sh"], {"NPROC": "2"}, signal.SIGINT, id="torchrun-sigint"),
    pytest.param(["launch/mpirun.sh"], {"NP": "2"}, signal.SIGTERM, id="mpirun-sigterm"),
]


@pytest.mark.slow
@pytest.mark.parametrize("launcher, variables, sig", LAUNCHERS)
def test_a_launcher_stopped_by_a_signal_exits_75_and_the_same_command_resumes(tmp_path, launcher, variables, sig):
    """The first job is stopped by `sig` to the launcher script alone; the rerun, which resumes, by SIGTERM to its
    whole process group, as `timeout`, a terminal's Ctrl-C and Slurm signal every process of the job. The ranks get
    that one twice, directly and relayed by the launcher: the repeat within runtime/signals.py's REPEAT_WINDOW_S is
    the same request, so it is the checkpointed stop and exit 75, as a signal to the script alone (was exit 1, a
    stop at once)."""
    if "mpirun" in launcher[0] and shutil.which("mpirun") is None:
        pytest.skip("Open MPI's mpirun is not installed; run .ci/install-system.sh as root")
    command = [str(ROOT / launcher[0]), *ENDLESS]
    code, out, err = _stop_with(command, tmp_path, sig, _env(**variables))
    assert code == 75, err[-3000:]
    assert f"stopped by {sig.name} after iteration" in err and "Traceback" not in err, err[-3000:]
    (run_dir,) = run_dirs(tmp_path)
    code, out, err = _stop_with(command, tmp_path, signal.SIGTERM, _env(**variables), group=True)
    assert code == 75 and f"runs/{run_dir} (this command's unfinished run); resuming from" in out, out[-3000:]
    assert "stopped by SIGTERM after iteration" in err and "Traceback" not in err, err[-3000:]
    assert run_dirs(tmp_path) == [run_dir]


def _catches(pid: int, signum: int) -> bool:
    """Whether the process has a handler for signum (its SigCgt mask in /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) & (1 << (signum - 1)))
    return False


def test_a_signal_while_starting_is_one_line_and_exit_128_plus_its_number(tmp_path):
    # The signal goes as soon as the early handlers are in place (a tenth of a second after launch), while the
    # process still imports torch: a fixed delay (1.5 s) was after the whole tiny run on a quiet machine.
    job = subprocess.Popen(
        [sys.executable, "-m", "spmd_rl.main", "--config", TINY, f"run.dir={tmp_path / 'run'}"],
        cwd=tmp_path,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 30
    while not _catches(job.pid, signal.SIGTERM):
        assert job.poll() is None and time.monotonic() < deadline, "no SIGTERM handler within 30 s of launch"
        time.sleep(0.01)
    job.send_signal(signal.SIGTERM)
    _, err = job.communicate(timeout=60)
    assert job.returncode == 128 + signal.SIGTERM, err
    assert "stopped by SIGTERM" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
