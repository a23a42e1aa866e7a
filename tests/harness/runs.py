"""`python -m spmd_rl.main` runs of the shipped tiny configs, and the checks on what a run leaves behind."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from harness.forked import forks_like_a_fresh_interpreter, run_forked_job, run_forked_process
from harness.launch import PYTHON, ROOT, command, job_env

TINY = str(ROOT / "configs" / "ci_tiny.yaml")
REQUIRED_METRICS = {
    "iteration",
    "env_steps",
    "episode_return_mean",
    "episode_length_mean",
    "sps",
    "time_env_s",
    "time_inference_s",
    "time_transfer_s",
    "time_learn_s",
    "time_weight_sync_s",
}
# The smallest split layout: 1 trainer, 1 inference rank, 2 env ranks (4 ranks)
SPLIT4 = ("layout.mode=split", "layout.trainer=1", "layout.inference=1", "layout.env=2")
PPO_METRICS = {"policy_loss", "value_loss", "entropy", "approx_kl", "clip_fraction", "explained_variance"}
# SAC on Pendulum in 96 steps (the end-to-end runs) ...
SAC_TINY = [
    "--config",
    str(ROOT / "configs" / "sac_pendulum.yaml"),
    "algo.num_steps=4",
    "train.total_steps=96",
    "algo.learning_starts=32",
    "algo.batch_size=16",
    "policy.hidden_sizes=[16,16]",
    "log.progress=false",
    "log.tensorboard=false",
]
# ... and in 160 steps with smaller critics (the resume runs: long enough to stop halfway after learning started).
SAC_RESUME_TINY = [
    "--config",
    str(ROOT / "configs" / "sac_pendulum.yaml"),
    "algo.num_steps=4",
    "train.total_steps=160",
    "algo.learning_starts=32",
    "algo.batch_size=16",
    "policy.hidden_sizes=[16,16]",
    "algo.critic_hidden_sizes=[16,16]",
    "log.progress=false",
    "log.tensorboard=false",
]
TIMINGS = ("sps", "wall_s", "cpu_s")


def run_main(
    *args,
    nproc: int = 0,
    timeout: float = 240,
    cwd: Path = ROOT,
    env: dict[str, str] | None = None,
    launcher: str = "forked",
) -> subprocess.CompletedProcess:
    """`python -m spmd_rl.main ARGS` in cwd (env: job_env() by default), forked from a warm interpreter
    (harness/forked.py): one process when nproc is 0, else nproc ranks started by hand (the job's code is its first
    failing rank's). launcher="none" (nproc 0) starts the command itself, as does an env whose PYTHON* or locale
    variables a fork cannot take; launcher="torchrun" starts the ranks under torchrun (whose code is 1 for any
    failure)."""
    env = job_env() if env is None else env
    if nproc and launcher == "forked":
        return run_forked_job(list(args), nproc, timeout, cwd, env)
    if not nproc and launcher == "forked" and forks_like_a_fresh_interpreter(env):
        return run_forked_process(list(args), timeout, cwd, env)
    line = command(launcher, nproc) if nproc else command("none")
    return subprocess.run(line + list(args), cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def run_main_measured(*args, cwd: Path = ROOT, timeout: float = 120) -> tuple[subprocess.CompletedProcess, float, int]:
    """`python -m spmd_rl.main ARGS`: the result, its wall time in seconds and a bound on its peak memory in MiB
    (wait4's maxrss, which on Linux also counts the forking test process's memory up to the exec)."""
    started = time.monotonic()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        child = subprocess.Popen(
            [PYTHON, "-m", "spmd_rl.main", *args],
            cwd=cwd,
            stdout=out,
            stderr=err,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        while True:
            pid, status, usage = os.wait4(child.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() - started > timeout:
                child.kill()
            time.sleep(0.01)
        child.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        result = subprocess.CompletedProcess(child.args, child.returncode, out.read(), err.read())
    return result, time.monotonic() - started, usage.ru_maxrss // 1024


def assert_one_line_exit_2(result: subprocess.CompletedProcess, *expected: str, max_chars: int = 600) -> str:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("spmd_rl:") and "error:" in lines[0], result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert len(lines[0]) <= max_chars, f"{len(lines[0])} characters: {lines[0][:300]}"
    assert all(text in lines[0] for text in expected), lines[0]
    return lines[0]


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def assert_run_complete(result, run_dir: Path, iterations: int, algo_metrics=PPO_METRICS) -> list[dict]:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    records = read_metrics(run_dir)
    assert [r["iteration"] for r in records] == list(range(iterations))
    assert REQUIRED_METRICS | algo_metrics <= set(records[-1])
    assert (run_dir / "config.yaml").is_file() and (run_dir / "policy.pt").is_file()
    assert "done:" in result.stdout
    return records


def records_without_timings(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [
        {k: v for k, v in json.loads(line).items() if not k.startswith("time_") and k not in TIMINGS} for line in lines
    ]


def assert_same_run(full, resumed):
    assert records_without_timings(resumed) == records_without_timings(full)
    a, b = torch.load(full / "policy.pt"), torch.load(resumed / "policy.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "final weights differ"


def assert_weights_close(first: Path, second: Path) -> None:
    """The two runs' policy.pt hold the same names and values within float error (1e-5): a sharded update of the
    same data as a replicated one."""
    a, b = (torch.load(run_dir / "policy.pt", weights_only=True) for run_dir in (first, second))
    assert sorted(a) == sorted(b)
    for key in a:
        assert torch.allclose(a[key].double(), b[key].double(), atol=1e-5, rtol=0), key


def assert_fsdp_equals_ddp(args, tmp_path: Path, **launch) -> None:
    """args trained with train.parallel=ddp and with fsdp (in tmp_path/ddp and tmp_path/fsdp) end with the same
    weights within float error. launch: run_main's keywords."""
    for parallel in ("ddp", "fsdp"):
        result = run_main(*args, f"train.parallel={parallel}", f"run.dir={tmp_path / parallel}", **launch)
        assert result.returncode == 0, result.stdout + result.stderr
    assert_weights_close(tmp_path / "ddp", tmp_path / "fsdp")


def assert_resumed_byte_for_byte(resumed, whole: Path, halves: Path, records=records_without_timings) -> None:
    """A resume (its result) in halves that ends as the uninterrupted run in whole did: the same metrics records
    (as `records` reads them) and policy.pt byte for byte."""
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resuming from" in resumed.stdout + resumed.stderr
    assert records(whole) == records(halves)
    assert (whole / "policy.pt").read_bytes() == (halves / "policy.pt").read_bytes()


def assert_halves_equal_whole(args, tmp_path: Path, half: int, **launch) -> list[dict]:
    """The run of args uninterrupted (in tmp_path/full), and stopped after `half` iterations (exit 75) then resumed
    (in tmp_path/split), end alike: metrics (timings aside) and final weights. The whole run's metrics records;
    launch: run_main's keywords."""
    full, parts = tmp_path / "full", tmp_path / "split"
    whole = run_main(*args, f"run.dir={full}", **launch)
    assert whole.returncode == 0, whole.stderr[-2000:]
    stopped = run_main(*args, f"run.dir={parts}", f"run.stop_after_iterations={half}", **launch)
    assert stopped.returncode == 75, stopped.stderr[-2000:]
    resumed = run_main(*args, f"run.dir={parts}", **launch)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resuming from" in resumed.stdout
    assert_same_run(full, parts)
    return read_metrics(full)
