"""The launcher scripts keep the exit-code promise, tried the way it happens (real torchrun, real mpirun, signals to
the whole process group as a terminal's Ctrl-C, `timeout` or Slurm send them, kill -9 of the group):
- a layout error is exit 2 and the ranks' one line (under launch/torchrun.sh without torchrun's report);
- SIGTERM while the agent starts, while the ranks start, and while they train: one line, and 143 or 75;
- kill -9 of launch/torchrun.sh's group: the ranks (in sessions of their own, which the kill does not reach) see
  their agent go and stop with a checkpoint, releasing the run directory, and rerunning the command resumes; the
  same for plain torchrun, whose agent the kill takes.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from harness.launch import ROOT, command, job_env, with_pythonpath

from spmd_rl.persist.run_lock import read_lock

TINY = str(ROOT / "configs" / "ci_tiny.yaml")
ENDLESS = ["--config", TINY, "train.total_steps=100000000"]
BOUND_S = 180  # a hang's bound, far above what each job takes on a quiet machine

pytestmark = pytest.mark.slow

needs_mpirun = pytest.mark.skipif(shutil.which("mpirun") is None, reason="Open MPI's mpirun is not installed")


def _start(script: str, args: list[str], cwd: Path, **env_vars: str) -> subprocess.Popen:
    """launch/<script> (or plain torchrun for "torchrun") with 2 ranks, in a session of its own."""
    env = with_pythonpath(job_env(**{"PYTHON": sys.executable, "NPROC": "2", "NP": "2", **env_vars}), ROOT)
    line = command("torchrun", 2, standalone=True) if script == "torchrun" else [str(ROOT / "launch" / script)]
    return subprocess.Popen(
        [*line, *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def _ranks(cwd: Path) -> list[int]:
    """The pids of the ranks working in cwd (each test has its own)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_text().split("\0")
            launcher = "torch.distributed.run" in argv or Path(argv[0]).name in ("mpirun", "setpriv")
            if "spmd_rl.main" in argv and not launcher and os.readlink(proc / "cwd") == str(cwd):
                pids.append(int(proc.name))
        except (OSError, ValueError):
            continue
    return pids


def _finish(job: subprocess.Popen, cwd: Path) -> tuple[int, str]:
    try:
        output, _ = job.communicate(timeout=BOUND_S)
    except subprocess.TimeoutExpired:
        output = ""
    finally:
        for pid in [job.pid, *_ranks(cwd)]:  # nothing outlives the test, a hang included
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass
    assert job.returncode is not None, f"still running after {BOUND_S} s (a hang)"
    return job.returncode, output


def _wait_for(condition, job: subprocess.Popen, what: str) -> None:
    deadline = time.monotonic() + BOUND_S
    while not condition():
        assert job.poll() is None, f"the job ended before {what}: {job.communicate()[0][-3000:]}"
        assert time.monotonic() < deadline, f"no {what} after {BOUND_S} s"
        time.sleep(0.05)


def _lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.strip()]


@pytest.mark.parametrize("script", ["torchrun.sh", pytest.param("mpirun.sh", marks=needs_mpirun)])
def test_a_layout_error_is_exit_2_and_the_ranks_one_line(tmp_path, script):
    layout = ["layout.mode=split", "layout.trainer=1", "layout.inference=1", "layout.env=1"]
    code, output = _finish(_start(script, ["--config", TINY, *layout], tmp_path), tmp_path)
    error = (
        "spmd_rl: error: layout.mode=split needs at least 3 ranks (a trainer, an inference and an env rank), and this "
        "run has 2: start more ranks (torchrun --nproc_per_node, mpirun -n) or set layout.mode=colocated"
    )
    assert code == 2, output
    if script == "torchrun.sh":
        assert _lines(output) == [error], output  # no banner, no agent log, no ChildFailedError report
    else:  # mpirun adds its own note of which process exited non-zero
        assert _lines(output)[0] == error and output.count("spmd_rl:") == 1, output


@pytest.mark.parametrize(
    "script, moment",
    [
        ("torchrun.sh", "agent starting"),
        ("torchrun.sh", "ranks starting"),
        ("torchrun.sh", "training"),
        pytest.param("mpirun.sh", "ranks starting", marks=needs_mpirun),
    ],
)
def test_sigterm_to_the_group_at_any_moment_is_one_line_and_143_or_75(tmp_path, script, moment):
    job = _start(script, ENDLESS, tmp_path)
    if moment == "agent starting":
        time.sleep(0.5)  # the agent is importing torch; no rank exists yet
    elif moment == "ranks starting":
        _wait_for(lambda: _ranks(tmp_path), job, "rank process")
    else:
        _wait_for(lambda: any(p.stat().st_size for p in tmp_path.glob("runs/*/metrics.jsonl")), job, "metrics")
    os.killpg(job.pid, signal.SIGTERM)
    code, output = _finish(job, tmp_path)
    said = [line for line in _lines(output) if not line.startswith(("spmd_rl: launcher ", "iter "))]
    assert len(said) == 1 and "stopped by SIGTERM" in said[0], output
    # "ranks starting" is when the signal is sent, not when it lands: mpirun passes it on to the ranks about a second
    # later, which on a quiet machine is after their first iterations. Whenever it lands, the exit code says what
    # the line says: 75 with a checkpoint to resume from, 128 + SIGTERM before the first iteration.
    checkpointed = "checkpoint" in said[0]
    if moment == "training":
        assert checkpointed, output
    elif moment == "agent starting":
        assert not checkpointed, output
    assert code == (75 if checkpointed else 128 + signal.SIGTERM), output
    if checkpointed:
        assert "rerun the same command to resume" in said[0], output


@pytest.mark.parametrize("script", ["torchrun.sh", pytest.param("mpirun.sh", marks=needs_mpirun)])
def test_a_hangup_of_the_group_while_training_stops_with_a_checkpoint_and_75(tmp_path, script):
    # The terminal closed: SIGHUP to the script's group. The script passes it on (as SIGTERM) and waits for the job:
    # it died of it, silently, and the stop line and the job's code went with it (fault pass 4, N6).
    job = _start(script, ENDLESS, tmp_path)
    _wait_for(lambda: any(p.stat().st_size for p in tmp_path.glob("runs/*/metrics.jsonl")), job, "metrics")
    os.killpg(job.pid, signal.SIGHUP)
    code, output = _finish(job, tmp_path)
    said = [line for line in _lines(output) if not line.startswith(("spmd_rl: launcher ", "iter "))]
    assert code == 75, output
    # the line names the signal sent, not the SIGTERM the script passes on for it (fault pass 6, X1)
    assert len(said) == 1 and "stopped by SIGHUP after iteration" in said[0] and "checkpoint" in said[0], output


# launch/torchrun.sh runs the agent in a group of its own, with setpriv's parent-death SIGTERM: the agent stops
# the ranks. Plain torchrun's group holds the agent: the kill takes it, and the ranks watch it go themselves.
@pytest.mark.parametrize("script", ["torchrun.sh", "torchrun"])
def test_kill_9_of_the_launchers_group_stops_the_ranks_with_a_checkpoint_and_a_rerun_resumes(tmp_path, script):
    # a resume writes its metrics records once its first checkpoint commits (docs/storage-and-resume.md): every 20
    # iterations, the rerun's come within seconds, not after checkpoint.every_s
    endless = [*ENDLESS, "checkpoint.every_iterations=20"]
    job = _start(script, endless, tmp_path)
    _wait_for(lambda: any(p.stat().st_size for p in tmp_path.glob("runs/*/metrics.jsonl")), job, "metrics")
    ranks = _ranks(tmp_path)
    assert len(ranks) == 2
    os.killpg(job.pid, signal.SIGKILL)  # the script, the agent and the output filter; not the ranks' sessions
    deadline = time.monotonic() + BOUND_S
    while any(Path(f"/proc/{pid}").exists() for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [pid for pid in ranks if Path(f"/proc/{pid}").exists()]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    job.communicate()
    assert not left, f"ranks {left} still running {BOUND_S} s after their agent was killed"
    (run_dir,) = tmp_path.glob("runs/*")
    assert not read_lock(run_dir)[0], "the run directory's lock is still held: a rerun could not take it"
    assert list((run_dir / "checkpoints").glob("iter_*")), "the stop left no checkpoint"
    records = run_dir.joinpath("metrics.jsonl").read_text().count("\n")
    rerun = _start(script, endless, tmp_path)
    _wait_for(lambda: run_dir.joinpath("metrics.jsonl").read_text().count("\n") > records, rerun, "resumed metrics")
    os.killpg(rerun.pid, signal.SIGTERM)
    code, output = _finish(rerun, tmp_path)
    assert f"{run_dir.relative_to(tmp_path)} (this command's unfinished run); resuming from" in output, output
    assert code == (75 if script == "torchrun.sh" else 1), output  # plain torchrun: 1 after a clean stop


def test_a_stop_the_config_asked_for_ends_plain_torchrun_with_0_and_no_failed_report(tmp_path):
    # run.stop_after_iterations is no failure: the ranks end 0 under plain torchrun (75 would be its FAILED /
    # ChildFailedError report and exit 1); run.lock records the stop, to resume
    run_dir = tmp_path / "run"
    job = _start("torchrun", ["--config", TINY, f"run.dir={run_dir}", "run.stop_after_iterations=2"], tmp_path)
    code, output = _finish(job, tmp_path)
    assert code == 0, output[-4000:]
    assert "FAILED" not in output and "ChildFailedError" not in output and "Traceback" not in output, output
    said = [line for line in _lines(output) if "stopped by run.stop_after_iterations=2" in line]
    assert len(said) == 1 and "rerun the same command to resume" in said[0], output
    assert read_lock(run_dir)[1]["exit_code"] == 75


def test_the_script_started_as_a_background_job_says_that_ctrl_c_will_not_reach_it(tmp_path):
    # `launch/torchrun.sh ... &` in a script: bash starts it with SIGINT ignored, which it cannot trap
    env = with_pythonpath(job_env(PYTHON=sys.executable, NPROC="1"), ROOT)
    script = f"{ROOT / 'launch' / 'torchrun.sh'} --config {TINY} run.dir={tmp_path / 'run'} train.total_steps=64"
    done = subprocess.run(
        ["bash", "-c", f"{script} & wait $!"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=BOUND_S
    )
    assert done.returncode == 0, done.stdout + done.stderr
    notes = [line for line in _lines(done.stdout + done.stderr) if "SIGINT ignored" in line]
    assert len(notes) == 1 and "Ctrl-C will not reach this job; stop it with SIGTERM" in notes[0], done.stdout


def test_ctrl_c_under_plain_torchrun_is_acknowledged_once_and_stops_once(tmp_path):
    # A terminal's Ctrl-C: SIGINT to the whole foreground group, the agent and every rank. One acknowledgement
    # (rank 0's), one stop line; the agent's own SignalException traceback is torchrun's (docs/failures.md).
    job = _start("torchrun", ENDLESS, tmp_path)
    _wait_for(lambda: any(p.stat().st_size for p in tmp_path.glob("runs/*/metrics.jsonl")), job, "metrics")
    os.killpg(job.pid, signal.SIGINT)
    _, output = _finish(job, tmp_path)
    lines = _lines(output)
    acknowledged = [line for line in lines if "SIGINT: stopping after this iteration with a checkpoint" in line]
    stopped = [line for line in lines if "stopped by SIGINT after iteration" in line]
    assert len(acknowledged) == 1 and len(stopped) == 1, output
    assert "rerun the same command to resume" in stopped[0], output


def test_a_failed_attempts_line_is_heard_while_the_restarted_attempt_runs(tmp_path):
    # MAX_RESTARTS=1, kill -9 of rank 1: rank 0's line about it passes the script's output filter as it is written,
    # not when the restarted attempt's job ends (mawk read the pipe in 4 KiB blocks: fault pass 4, D8).
    job = _start("torchrun.sh", [*ENDLESS, "checkpoint.every_iterations=20"], tmp_path, MAX_RESTARTS="1")
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(job.stdout.readline, "")), daemon=True)
    reader.start()
    # a committed checkpoint (its COMPLETE marker): a directory still being saved is no checkpoint to resume from
    _wait_for(lambda: list(tmp_path.glob("runs/*/checkpoints/iter_*/COMPLETE")), job, "checkpoint")
    (rank_1,) = [pid for pid in _ranks(tmp_path) if "RANK=1" in _environ(pid)]
    os.kill(rank_1, signal.SIGKILL)
    _wait_for(lambda: any(line.startswith("spmd_rl: rank 0 ") for line in lines), job, "line from rank 0")
    assert not any("resuming from" in line for line in lines), "the line came after the restarted attempt began"
    # the restarted attempt resumes and trains; then it stops with a checkpoint
    _wait_for(lambda: any("resuming from" in line for line in lines[:-1]), job, "restarted attempt's iteration")
    os.killpg(job.pid, signal.SIGTERM)
    try:
        job.wait(timeout=BOUND_S)
    finally:
        for pid in [job.pid, *_ranks(tmp_path)]:
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass
    reader.join(timeout=10)
    output = "".join(lines)
    assert job.returncode == 75, output
    assert output.count("resuming from") == 1 and "stopped by SIGTERM after iteration" in output, output


def test_a_stopped_env_rank_under_torchrun_sh_is_the_ranks_lines_and_the_summary_without_the_agents(tmp_path):
    # The agent gives the SIGSTOPped rank its shutdown timeout to take SIGTERM, then kills it and logs "Unable to
    # shutdown process ..., forcefully exiting": rank 0 has spoken for the job by then (fault pass 4, D2). The
    # timeout is 30 s by default; 3 s here to keep the test short.
    split = ["layout.mode=split", "layout.trainer=1", "layout.inference=1", "layout.env=2", "dist.timeout_s=8"]
    code, said, output = _signal_a_rank_while_training(
        tmp_path,
        "torchrun.sh",
        [*ENDLESS, *split],
        "RANK=3",
        signal.SIGSTOP,
        NPROC="4",
        TORCH_ELASTIC_SHUTDOWN_TIMEOUT="3",
    )
    assert code == 3, output
    assert said[-1].startswith("spmd_rl: job summary: rank 3 (env 1) stopped responding first"), output
    assert all(line.startswith("spmd_rl: ") for line in said), output


@pytest.mark.parametrize("script", ["torchrun.sh", pytest.param("mpirun.sh", marks=needs_mpirun)])
def test_a_rank_killed_before_the_group_forms_is_exit_3_with_the_launchers_report_kept(tmp_path, script):
    # Rank 1 ends by SIGKILL in its check before start; the agent stops rank 0 with SIGTERM, whose code (143) read
    # as rank 0 speaking for the job: the agent's report, the only account of rank 1, was dropped and the script
    # exited 1 after rank 0's "stopped by SIGTERM while starting" (fault pass 5, J6).
    killed = "policy.class=tests.harness.rank_one_faults:KilledOnRankOne"
    job = _start(script, ["--config", TINY, killed, f"run.dir={tmp_path / 'run'}"], tmp_path)
    code, output = _finish(job, tmp_path)
    assert code == 3, output
    named = ("local_rank: 1", "exitcode: -9") if script == "torchrun.sh" else ("process rank 1", "signal 9")
    assert all(part in output for part in named), output  # the launcher's report naming it
    assert "a rank ended before it could say why" in output.splitlines()[-1], output


@pytest.mark.parametrize("script", ["torchrun.sh", pytest.param("mpirun.sh", marks=needs_mpirun)])
def test_a_hang_importing_a_plugin_on_rank_1_is_its_line_and_exit_4(tmp_path, script):
    # Rank 1's watchdog ends it with its line before the group forms; the launcher stops rank 0. The script exits
    # 4 with the summary from rank 1's record, without the launcher's report (rank 1 spoke): it was exit 3 and "a
    # rank ended before it could say why" (fault pass 6, U3b)
    hangs = "policy.class=tests.harness.rank_one_import_hang:Policy"
    job = _start(script, ["--config", TINY, hangs, f"run.dir={tmp_path / 'run'}", "dist.timeout_s=20"], tmp_path)
    code, output = _finish(job, tmp_path)
    said = _lines(output)
    assert code == 4, output
    assert said[0].startswith("spmd_rl: rank 1: importing module 'tests.harness.rank_one_import_hang'"), output
    assert said[-1] == "spmd_rl: job summary: rank 1 failed first (error in user code: see its line)", output
    assert not any(part in output for part in ("ChildFailedError", "exitcode", "mpirun noticed", "before it could")), (
        output
    )


@pytest.mark.parametrize("script", ["torchrun.sh", pytest.param("mpirun.sh", marks=needs_mpirun)])
def test_kill_9_of_the_launcher_alone_is_the_ranks_stop_or_one_line_naming_it(tmp_path, script):
    # torchrun's ranks see their agent go and stop with a checkpoint (75); mpirun's end with it, and the script
    # says so (it blamed a rank that "ended before it could say why", exit 3: fault pass 5, M1). Neither prints
    # bash's notice of a killed job with the launcher's whole command line (J4).
    job = _start(script, [*ENDLESS, "checkpoint.every_iterations=50"], tmp_path)
    _wait_for(lambda: any(p.stat().st_size for p in tmp_path.glob("runs/*/metrics.jsonl")), job, "metrics")
    (launcher,) = [pid for pid in _children(job.pid) if "spmd_rl.main" in _cmdline(pid)]
    os.kill(launcher, signal.SIGKILL)
    code, output = _finish(job, tmp_path)
    assert "Killed" not in output, output
    if script == "torchrun.sh":
        assert code == 75 and "stopped by SIGTERM" in output, output  # the agent's death signal, or their own
    else:
        assert code == 137, output
        assert output.splitlines()[-1] == (
            f"spmd_rl: mpirun.sh: the launcher (pid {launcher}) was killed by SIGKILL, not by this script, and the "
            "ranks ended with it: rerun the same command to resume from the last checkpoint"
        ), output


def _children(pid: int) -> list[int]:
    try:
        return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
    except OSError:
        return ""


@needs_mpirun
def test_sigterm_to_one_rank_under_mpirun_sh_is_the_stop_line_and_75_without_mpiruns_box(tmp_path):
    # The ranks agree on the stop and exit 75; mpirun then prints its "exited with non-zero status" box (11 lines),
    # which the script drops once rank 0 has spoken for the job (its stop line, its code in $SPMD_RL_EXIT_FILE).
    code, said, output = _signal_a_rank_while_training(
        tmp_path, "mpirun.sh", ENDLESS, "OMPI_COMM_WORLD_RANK=1", signal.SIGTERM
    )
    assert code == 75, output
    assert len(said) == 1 and "stopped by SIGTERM after iteration" in said[0], output


@pytest.mark.parametrize("script", ["torchrun.sh", "torchrun"])
def test_sigterm_to_one_rank_under_torchrun_stops_every_rank_with_a_checkpoint(tmp_path, script):
    # Every rank agrees on the stop and exits 75. launch/torchrun.sh exits 75 with the stop line alone; plain
    # torchrun's agent reports the 75s as a failure (its FAILED block, exit 1), which the stop line says before it.
    code, said, output = _signal_a_rank_while_training(tmp_path, script, ENDLESS, "RANK=1", signal.SIGTERM)
    stopped = [line for line in said if "stopped by SIGTERM after iteration" in line]
    assert len(stopped) == 1 and "rerun the same command to resume" in stopped[0], output
    assert ("plain torchrun reports the stop as a failure below" in stopped[0]) == (script == "torchrun"), output
    if script == "torchrun.sh":
        assert code == 75 and "FAILED" not in output, output
    else:
        assert code == 1, output
    (run_dir,) = tmp_path.glob("runs/*")
    assert read_lock(run_dir)[1]["exit_code"] == 75
    assert (run_dir / "checkpoints" / "latest").exists()


@needs_mpirun
def test_sigusr1_to_the_group_under_mpirun_sh_is_the_ranks_lines_without_mpiruns_forwarding_note(tmp_path):
    job = _start("mpirun.sh", ENDLESS, tmp_path)
    _wait_for(lambda: any(p.stat().st_size for p in tmp_path.glob("runs/*/metrics.jsonl")), job, "metrics")
    os.killpg(job.pid, signal.SIGUSR1)
    code, output = _finish(job, tmp_path)
    said = [line for line in _lines(output) if not line.startswith(("spmd_rl: launcher ", "iter "))]
    assert code == 75 and "Forwarding signal" not in output, output  # fault pass 5, S2: it passed the filter
    assert said[-1].startswith("spmd_rl: stopped by SIGUSR1 after iteration"), output


def _signal_a_rank_while_training(
    tmp_path: Path, script: str, args: list[str], rank_variable: str, sig: signal.Signals, **env_vars: str
) -> tuple[int, list[str], str]:
    """The job's exit code, its lines other than the start and iteration lines, and its whole output, after sig to
    the rank whose environment holds rank_variable once the job trains."""
    job = _start(script, args, tmp_path, **env_vars)
    _wait_for(lambda: any(p.stat().st_size for p in tmp_path.glob("runs/*/metrics.jsonl")), job, "metrics")
    (rank,) = [pid for pid in _ranks(tmp_path) if rank_variable in _environ(pid)]
    os.kill(rank, sig)
    code, output = _finish(job, tmp_path)
    return code, [line for line in _lines(output) if not line.startswith(("spmd_rl: launcher ", "iter "))], output


def _environ(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/environ").read_text().split("\0")
    except OSError:
        return []
