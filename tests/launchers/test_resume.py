"""Checkpoints and resume, end to end: N iterations in one go equal N/2, a stop, and a resume of the same command,
line for line (timings aside) and byte for byte (the final weights); signals stop every rank at one iteration with
a checkpoint; run directories that would mix two runs are refused.
"""

import json
import shutil
import signal
import subprocess
import time

import pytest
import torch
from harness.launch import ROOT, command
from harness.launch import job_env as _env
from harness.runs import SAC_RESUME_TINY as SAC_TINY
from harness.runs import TINY, assert_same_run, records_without_timings, run_main

SPLIT4 = ["layout.mode=split", "layout.trainer=1", "layout.inference=1", "layout.env=2"]


CASES = {
    "ppo-one-process": ([TINY], 0, 4),
    "ppo-colocated-2": ([TINY], 2, 2),
    "ppo-split-4": ([TINY, *SPLIT4], 4, 2),
    "sac-one-process-memory": ([*SAC_TINY], 0, 20),
    "sac-one-process-hdf5": ([*SAC_TINY, "buffer.backend=hdf5", "buffer.log_experience=true"], 0, 20),
    "sac-colocated-2-memory": ([*SAC_TINY], 2, 10),
    "sac-colocated-2-hdf5": ([*SAC_TINY, "buffer.backend=hdf5"], 2, 10),
    "sac-split-4-hdf5": ([*SAC_TINY, *SPLIT4, "buffer.backend=hdf5", "buffer.log_experience=true"], 4, 10),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_n_iterations_equal_half_then_resume(tmp_path, case):
    args, nproc, half = CASES[case]
    args = ["--config", *args] if args[0] != "--config" else args
    full = run_main(*args, f"run.dir={tmp_path / 'full'}", nproc=nproc)
    assert full.returncode == 0, full.stderr[-2000:]
    stopped = run_main(*args, f"run.dir={tmp_path / 'split'}", f"run.stop_after_iterations={half}", nproc=nproc)
    assert stopped.returncode == 75, stopped.stderr[-2000:]
    assert "rerun the same command to resume" in stopped.stderr
    resumed = run_main(*args, f"run.dir={tmp_path / 'split'}", f"run.stop_after_iterations={half}", nproc=nproc)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resuming from" in resumed.stdout
    assert_same_run(tmp_path / "full", tmp_path / "split")


@pytest.mark.slow
def test_a_finished_run_and_a_different_config_are_refused(tmp_path):
    run_dir = tmp_path / "run"
    assert run_main("--config", TINY, f"run.dir={run_dir}").returncode == 0
    again = run_main("--config", TINY, f"run.dir={run_dir}")
    assert again.returncode == 2 and "holds a finished run" in again.stderr
    assert len(again.stderr.strip().splitlines()) == 1

    stopped = tmp_path / "stopped"
    assert run_main("--config", TINY, f"run.dir={stopped}", "run.stop_after_iterations=2").returncode == 75
    other = run_main("--config", TINY, f"run.dir={stopped}", "algo.learning_rate=0.5")
    assert other.returncode == 2 and "different config" in other.stderr
    never = run_main("--config", TINY, f"run.dir={stopped}", "run.resume=never")
    assert never.returncode == 2 and "run.resume=never" in never.stderr
    # A resumed run keeps the stopped run's records up to the checkpoint, then continues them: no duplicates.
    resumed = run_main("--config", TINY, f"run.dir={stopped}")
    assert resumed.returncode == 0, resumed.stderr
    assert [r["iteration"] for r in records_without_timings(stopped)] == list(range(8))


@pytest.mark.slow
def test_sigterm_stops_every_rank_at_one_iteration_with_a_checkpoint_and_the_run_resumes(tmp_path):
    # Ranks started by torchrun; SIGTERM to ONE worker: the ranks agree to stop at the same iteration.
    run_dir = tmp_path / "run"
    args = [TINY, f"run.dir={run_dir}", "train.total_steps=200000", "algo.update_epochs=1", *SPLIT4]
    cmd = [
        *command("torchrun", 4, standalone=True),
        "--config",
        *args,
    ]
    process = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (run_dir / "metrics.jsonl").exists() or len((run_dir / "metrics.jsonl").read_text().splitlines()) < 3:
        assert time.monotonic() < deadline and process.poll() is None, "the run did not start"
        time.sleep(0.2)
    workers = subprocess.run(["pgrep", "-f", f"run.dir={run_dir}"], capture_output=True, text=True).stdout.split()
    env_rank = max(int(pid) for pid in workers)  # the youngest process: a worker, not the agent
    subprocess.run(["kill", "-TERM", str(env_rank)])
    _, stderr = process.communicate(timeout=120)
    assert "rerun the same command to resume" in stderr, stderr[-3000:]
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    stopped_at = int(latest.split("_")[-1])
    assert (run_dir / "policy.pt").is_file()
    assert [r["iteration"] for r in records_without_timings(run_dir)] == list(range(stopped_at + 1))
    # The same command resumes (stopping again a few iterations later, to keep the test short).
    resumed = run_main("--config", *args, f"run.stop_after_iterations={stopped_at + 4}", nproc=4, timeout=120)
    assert "resuming from" in resumed.stdout, resumed.stderr[-3000:]
    assert [r["iteration"] for r in records_without_timings(run_dir)] == list(range(stopped_at + 4))


def test_one_process_sigterm_exits_75_with_one_line(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [*command("none"), "--config", TINY, f"run.dir={run_dir}", "train.total_steps=400000"]
    process = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not (run_dir / "metrics.jsonl").exists():
        assert time.monotonic() < deadline and process.poll() is None, "the run did not start"
        time.sleep(0.1)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 75, stderr
    assert stderr.strip().splitlines()[-1].startswith("spmd_rl: stopped by SIGTERM after iteration")
    assert (run_dir / "policy.pt").is_file() and (run_dir / "checkpoints" / "latest").is_file()


def test_a_truncated_checkpoint_is_a_user_error_naming_the_file(tmp_path):
    run_dir = tmp_path / "run"
    assert run_main("--config", TINY, f"run.dir={run_dir}", "run.stop_after_iterations=2").returncode == 75
    latest = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()
    rank_file = latest / "rank0.pt"
    rank_file.write_bytes(rank_file.read_bytes()[:100])
    result = run_main("--config", TINY, f"run.dir={run_dir}")
    assert result.returncode == 2, result.stderr
    assert "rank0.pt" in result.stderr and len(result.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_fine_tune_from_a_run_and_periodic_evaluation(tmp_path):
    first = tmp_path / "first"
    assert run_main("--config", TINY, f"run.dir={first}", "eval.every=4", "eval.episodes=2").returncode == 0
    records = [json.loads(line) for line in (first / "metrics.jsonl").read_text().splitlines()]
    assert [("eval_return_mean" in r) for r in records] == [i % 4 == 3 for i in range(8)]
    # Evaluating on envs of its own does not change training: the same run without it has the same weights.
    plain = tmp_path / "plain"
    assert run_main("--config", TINY, f"run.dir={plain}").returncode == 0
    a, b = torch.load(first / "policy.pt"), torch.load(plain / "policy.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)
    # A new run starts from the trained policy (and, from a checkpoint, the optimizer's state).
    tuned = tmp_path / "tuned"
    result = run_main(
        "--config",
        TINY,
        f"run.dir={tuned}",
        f"run.init_from={first}",
        "run.init_algorithm=true",
        "train.total_steps=32",
    )
    assert result.returncode == 0, result.stderr
    initial = torch.load(first / "policy.pt")
    after_one_update = torch.load(tuned / "policy.pt")
    moved = [k for k in initial if not torch.equal(initial[k], after_one_update[k])]
    fresh = tmp_path / "fresh"
    assert run_main("--config", TINY, f"run.dir={fresh}", "train.total_steps=32").returncode == 0
    assert moved and not torch.equal(
        torch.load(fresh / "policy.pt")["actor.0.weight"], after_one_update["actor.0.weight"]
    )


def test_a_run_without_a_checkpoint_starts_over_with_a_line_saying_so(tmp_path):
    run_dir = tmp_path / "run"
    stopped = run_main("--config", TINY, f"run.dir={run_dir}", "run.stop_after_iterations=2")
    assert stopped.returncode == 75, stopped.stderr
    shutil.rmtree(run_dir / "checkpoints")  # as if it had been killed before its first checkpoint
    again = run_main("--config", TINY, f"run.dir={run_dir}")
    assert again.returncode == 0, again.stderr
    assert f"spmd_rl: note: {run_dir} holds this run's metrics.jsonl" in again.stdout
    assert "but no checkpoint: cleared, the run starts over" in again.stdout
    assert [json.loads(line)["iteration"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == list(
        range(8)
    )
