"""A one-process run forked from the warm interpreter (harness/forked.py, what run_main does with nproc 0) starts
as `python -m` does: tests/harness/process_probe.py, started both ways with the same argv, cwd and environment,
reports the same process state, writes the same stdout and stderr, and exits with the same code; the global random
generators are the process's own, not the server's."""

import json
import os
import subprocess

import pytest
from harness.forked import ForkedJob, forks_like_a_fresh_interpreter
from harness.launch import PYTHON, ROOT, job_env, with_pythonpath

PROBE = "tests.harness.process_probe"


def _fresh(args, cwd, env):
    line = [PYTHON, "-m", PROBE, *args]
    return subprocess.run(line, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def _forked(args, cwd, env):
    return ForkedJob(args, [env], cwd, own_group=False, module=PROBE).wait(120)


def _state(result) -> dict:
    return json.loads(result.stdout.splitlines()[0])


ENVS = {
    "job_env": lambda tmp: job_env(),
    "warnings-and-threads": lambda tmp: job_env(PYTHONWARNINGS="error::DeprecationWarning", OMP_NUM_THREADS="1"),
    "pythonpath": lambda tmp: with_pythonpath(job_env(SPMD_RL_PROBE="x"), tmp, ROOT),
}


@pytest.mark.parametrize("env_name, code", [("job_env", 0), ("warnings-and-threads", 3), ("pythonpath", 0)])
def test_a_forked_process_starts_as_python_dash_m_does(tmp_path, env_name, code):
    env = ENVS[env_name](tmp_path)
    assert forks_like_a_fresh_interpreter(env)
    args, cwd = [str(code), "--flag", "a b"], ROOT if env_name == "job_env" else tmp_path
    if cwd != ROOT:
        env = with_pythonpath(env, ROOT)  # the probe module is found from another folder, as a user's would be
    fresh, forked, again = _fresh(args, cwd, env), _forked(args, cwd, env), _forked(args, cwd, env)
    assert fresh.returncode == forked.returncode == code, fresh.stderr + forked.stderr
    assert forked.stderr == fresh.stderr  # the warning once, then the probe's line
    assert fresh.stderr.count("UserWarning: the probe's warning") == 1 and fresh.stderr.endswith(
        "the probe's stderr line\n"
    )
    mine, theirs = _state(forked), _state(fresh)
    mine_draws, theirs_draws = mine.pop("draws"), theirs.pop("draws")
    assert mine == theirs
    assert mine["process_group"] == os.getpgrp()  # the test process's, as subprocess.run leaves a child
    for left, right in ((mine_draws, _state(again)["draws"]), (mine_draws, theirs_draws)):
        assert all(a != b for a, b in zip(left, right, strict=True)), (left, right)


def test_an_environment_a_fork_cannot_take_starts_the_command():
    assert not forks_like_a_fresh_interpreter(job_env(PYTHONHASHSEED="0"))
    assert not forks_like_a_fresh_interpreter(job_env(PYTHONUNBUFFERED=""))
    assert not forks_like_a_fresh_interpreter({k: v for k, v in job_env().items() if k != "PYTHONUNBUFFERED"})
    assert not forks_like_a_fresh_interpreter(job_env(LC_ALL="C"))
    assert not forks_like_a_fresh_interpreter(job_env(TORCH_SHOW_CPP_STACKTRACES="1"))
    assert forks_like_a_fresh_interpreter(job_env(OMP_NUM_THREADS="1", SPMD_RL_ANYTHING="x"))  # applied in the child
