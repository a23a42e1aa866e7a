"""Jobs of `python -m spmd_rl.main` ranks started by hand (RANK, WORLD_SIZE, MASTER_ADDR/PORT, no launcher agent)
and forked from a warm interpreter (rank_server.py), so that a rank starts in hundredths of a second instead of
about 2 CPU seconds. For tests about a run (resume, layouts, exactness), not about a launcher: those start torchrun,
mpirun or srun themselves.

    result = run_forked_job(["--config", TINY, "run.dir=..."], nproc=2)   # a subprocess.CompletedProcess

A job's ranks share a process group of their own. Its exit code is the first non-zero rank's in rank order (0 if
every rank succeeded), its stdout and stderr every rank's in rank order.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from harness.launch import PYTHON, ROOT, free_port, job_env, rank_env


class RankServer:
    """The warm interpreter of this test process (started at its first job) and the ends of its children."""

    _instance: RankServer | None = None

    def __init__(self):
        # torchrun's setting for its workers: the server's OpenMP threads are fixed when it imports torch
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        env.pop("PYTHONWARNINGS", None)  # a job's own is applied in its ranks
        self.process = subprocess.Popen(
            [PYTHON, str(Path(__file__).with_name("rank_server.py"))],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        self.ends: dict[int, int] = {}  # pid: exit code
        self.started: list[int] = []  # pids, in request order
        self.changed = threading.Condition()
        self.lock = threading.Lock()  # one request and its pid at a time
        threading.Thread(target=self._read_replies, daemon=True).start()

    @classmethod
    def get(cls) -> RankServer:
        if cls._instance is None or cls._instance.process.poll() is not None:
            cls._instance = RankServer()
        return cls._instance

    def _read_replies(self) -> None:
        for line in self.process.stdout:
            reply = json.loads(line)
            with self.changed:
                if "code" in reply:
                    self.ends[reply["pid"]] = reply["code"]
                else:  # a reused pid: its earlier process's end was reported before this fork
                    self.ends.pop(reply["pid"], None)
                    self.started.append(reply["pid"])
                self.changed.notify_all()

    def fork(self, argv: list[str], env: dict[str, str], cwd: Path, stdout: Path, stderr: Path, group: int) -> int:
        request = dict(argv=argv, env=env, cwd=str(cwd), stdout=str(stdout), stderr=str(stderr), group=group)
        with self.lock:
            with self.changed:
                count = len(self.started)
            self.process.stdin.write((json.dumps(request) + "\n").encode())
            self.process.stdin.flush()
            with self.changed:
                if not self.changed.wait_for(lambda: len(self.started) > count, timeout=60):
                    raise RuntimeError("tests/harness/rank_server.py did not answer a fork request within 60 s")
                return self.started[count]

    def wait(self, pids: list[int], deadline: float) -> bool:
        """Whether every pid ended before the deadline (time.monotonic())."""
        with self.changed:
            return self.changed.wait_for(
                lambda: all(pid in self.ends for pid in pids), timeout=max(0.0, deadline - time.monotonic())
            )


class ForkedJob:
    """nproc ranks of `python -m spmd_rl.main ARGS`, started by hand on this host (a store on a free port)."""

    def __init__(self, args: list[str], nproc: int, cwd: Path = ROOT, env: dict[str, str] | None = None):
        self.server = RankServer.get()
        self.args = [str(arg) for arg in args]
        self.folder = Path(tempfile.mkdtemp(prefix="spmd_rl_job_"))
        port = free_port()
        self.pids: list[int] = []
        for rank in range(nproc):
            ranks_env = {**(env if env is not None else job_env()), **rank_env(rank, nproc, port, OMP_NUM_THREADS="1")}
            group = self.pids[0] if self.pids else 0
            out, err = self.folder / f"rank{rank}.out", self.folder / f"rank{rank}.err"
            self.pids.append(self.server.fork(self.args, ranks_env, cwd, out, err, group))

    @property
    def group(self) -> int:
        return self.pids[0]

    def codes(self) -> list[int | None]:
        return [self.server.ends.get(pid) for pid in self.pids]

    def poll(self) -> int | None:
        codes = self.codes()
        return None if None in codes else next((code for code in codes if code), 0)

    def signal(self, sig: int) -> None:
        """sig to every rank of the job (its process group), as a launcher or a scheduler sends it."""
        try:
            os.killpg(self.group, sig)
        except ProcessLookupError:
            pass

    def output(self, stream: str) -> str:
        files = [self.folder / f"rank{rank}.{stream}" for rank in range(len(self.pids))]
        return "".join(file.read_text() for file in files if file.exists())  # a rank may die before it opens one

    def wait(self, timeout: float) -> subprocess.CompletedProcess:
        """The job's result once every rank has ended; at the timeout the ranks are killed and TimeoutExpired is
        raised, as subprocess.run does."""
        if not self.server.wait(self.pids, time.monotonic() + timeout):
            self.signal(signal.SIGKILL)
            self.server.wait(self.pids, time.monotonic() + 10)
            out, err = self.output("out"), self.output("err")
            shutil.rmtree(self.folder, ignore_errors=True)
            raise subprocess.TimeoutExpired(self.args, timeout, out, err)
        result = subprocess.CompletedProcess(self.args, self.poll(), self.output("out"), self.output("err"))
        shutil.rmtree(self.folder, ignore_errors=True)
        return result


def run_forked_job(
    args: list[str], nproc: int, timeout: float = 240, cwd: Path = ROOT, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """nproc ranks of `python -m spmd_rl.main ARGS` (env: the job's environment, job_env() by default), run to
    their end."""
    return ForkedJob(args, nproc, cwd, env).wait(timeout)
