"""`python -m spmd_rl.main` ends right after its last line: it waits for its threads and runs the atexit handlers as
Python's exit does, but skips the interpreter's teardown of every module (seconds with torch loaded: a refused second
copy of a running command exited 2.9-11.8 s after its refusal line; fault pass 2026-12-07, W1c). A module global's
finalizer is the witness: the teardown would run it, and nothing else does."""

from __future__ import annotations

import subprocess

from harness.launch import PYTHON, ROOT, job_env, with_pythonpath

PROBE = """
import atexit, os, threading, time

class Witness:
    def __del__(self):  # runs only when the interpreter tears the module down
        os.write(1, b"torn down\\n")

witness = Witness()
atexit.register(lambda: os.write(1, b"atexit ran\\n"))

def late():
    time.sleep(0.3)
    os.write(1, b"thread finished\\n")

threading.Thread(target=late).start()  # not a daemon: the exit waits for it
"""


def run_python(tmp_path, code: str) -> subprocess.CompletedProcess:
    (tmp_path / "end_probe.py").write_text(PROBE)
    env = with_pythonpath(job_env(), tmp_path, ROOT)
    return subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)


def test_end_process_waits_for_threads_and_runs_atexit_but_skips_the_teardown(tmp_path):
    result = run_python(tmp_path, "import end_probe\nfrom spmd_rl.runtime.exits import end_process\nend_process(3)")
    assert result.returncode == 3, result.stderr
    assert result.stdout.splitlines() == ["thread finished", "atexit ran"], result.stdout


def test_the_command_line_program_ends_through_it(tmp_path):
    code = (
        "import runpy, sys, end_probe\n"
        "sys.argv = ['spmd_rl.main', '--config', 'nothere.yaml']\n"
        "runpy.run_module('spmd_rl.main', run_name='__main__')"
    )
    result = run_python(tmp_path, code)
    assert result.returncode == 2 and "nothere.yaml does not exist" in result.stderr, result.stderr
    assert "atexit ran" in result.stdout and "torn down" not in result.stdout, result.stdout
