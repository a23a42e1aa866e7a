"""`python -m spmd_rl.main` forked from a warm interpreter (rank_server.py), so that a process starts in
hundredths of a second instead of about 2 CPU seconds: jobs of ranks started by hand (RANK, WORLD_SIZE,
MASTER_ADDR/PORT, no launcher agent), and single processes without a launcher. For tests about a run (resume,
layouts, exactness, bad input), not about a launcher or the command itself: those start torchrun, mpirun, srun or
`python -m spmd_rl.main` themselves.

    result = run_forked_job(["--config", TINY, "run.dir=..."], nproc=2)   # a subprocess.CompletedProcess
    result = run_forked_process(["--config", TINY, "run.dir=..."])        # as subprocess.run(command("none") + ...)

A job's ranks share a process group of their own (a single process has its own, as a process started from a shell
would). Its exit code is the first non-zero rank's in rank order (0 if every rank succeeded), its stdout and stderr
every rank's in rank order.
"""

from __future__ import annotations

import functools
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
        # This process's environment, unbuffered (as job_env()), on one OpenMP thread (torchrun's setting for its
        # workers; the server must start no OpenMP threads before it forks: a child sets its own number).
        self.environment = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        self.environment.pop("PYTHONWARNINGS", None)  # a job's own is applied in its ranks
        self.process = subprocess.Popen(
            [PYTHON, str(Path(__file__).with_name("rank_server.py"))],
            cwd=ROOT,
            env=self.environment,
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

    def fork(
        self, argv: list[str], env: dict[str, str], cwd: Path, stdout: Path, stderr: Path, group: int, module: str
    ) -> int:
        request = dict(argv=argv, env=env, cwd=str(cwd), stdout=str(stdout), stderr=str(stderr), group=group)
        request.update(module=module, threads=fresh_thread_counts(env))
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


# What sizes the thread pools as a library loads (thread_pools.py): a child sets the counts of a fresh interpreter.
_THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS")
# What an interpreter reads from the environment only as it starts (sys.flags, the stdio encoding, hash seed) or as
# torch and the thread runtimes load (TORCH_*, OpenMP's, MKL's): a fork has the server's. PYTHONPATH, PYTHONWARNINGS
# and the thread counts are applied in the child (rank_server.py).
_SET_AT_START = ("PYTHON", "LANG", "LC_", "TORCH", "OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "GOTO_")
_APPLIED_IN_CHILD = ("PYTHONPATH", "PYTHONWARNINGS", *_THREAD_VARIABLES)


def _read_at_start(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(_SET_AT_START) and k not in _APPLIED_IN_CHILD}


@functools.cache
def _fresh_thread_counts(variables: tuple[tuple[str, str], ...]) -> dict[str, int | None]:
    env = {k: v for k, v in os.environ.items() if k not in _THREAD_VARIABLES} | dict(variables)
    line = [PYTHON, str(Path(__file__).with_name("thread_pools.py"))]
    return json.loads(subprocess.run(line, env=env, capture_output=True, text=True, check=True, timeout=120).stdout)


def fresh_thread_counts(env: dict[str, str]) -> dict[str, int | None]:
    """torch's intra-op threads and numpy's OpenBLAS threads in a fresh interpreter under env (their variables
    decide, by rules of their own: asked of a fresh interpreter, once per set of values)."""
    return _fresh_thread_counts(tuple((k, env[k]) for k in _THREAD_VARIABLES if k in env))


def forks_like_a_fresh_interpreter(env: dict[str, str]) -> bool:
    """Whether a process forked from the server under env starts as a fresh `python -m` would: what an interpreter
    reads only as it starts is the server's (the environment it started with)."""
    return _read_at_start(env) == _read_at_start(RankServer.get().environment)


class ForkedJob:
    """`python -m MODULE ARGS` (spmd_rl.main) forked once per environment in envs: a job's ranks in rank order,
    sharing a process group of their own, or one process in the test process's group (own_group False), as
    subprocess.run starts one."""

    def __init__(
        self,
        args: list[str],
        envs: list[dict[str, str]],
        cwd: Path = ROOT,
        own_group: bool = True,
        module: str = "spmd_rl.main",
    ):
        self.server = RankServer.get()
        self.args = [str(arg) for arg in args]
        self.folder = Path(tempfile.mkdtemp(prefix="spmd_rl_job_"))
        self.own_group = own_group
        self.pids: list[int] = []
        for rank, env in enumerate(envs):
            group = (self.pids[0] if self.pids else 0) if own_group else -1
            out, err = self.folder / f"rank{rank}.out", self.folder / f"rank{rank}.err"
            self.pids.append(self.server.fork(self.args, env, cwd, out, err, group, module))

    @classmethod
    def ranks(cls, args: list[str], nproc: int, cwd: Path = ROOT, env: dict[str, str] | None = None) -> ForkedJob:
        """nproc ranks started by hand on this host (a store on a free port)."""
        port = free_port()
        base = env if env is not None else job_env()
        envs = [{**base, **rank_env(rank, nproc, port, OMP_NUM_THREADS="1")} for rank in range(nproc)]
        return cls(args, envs, cwd)

    @property
    def group(self) -> int:
        return self.pids[0]

    def codes(self) -> list[int | None]:
        return [self.server.ends.get(pid) for pid in self.pids]

    def poll(self) -> int | None:
        codes = self.codes()
        return None if None in codes else next((code for code in codes if code), 0)

    def signal(self, sig: int) -> None:
        """sig to every rank of the job (its process group), as a launcher or a scheduler sends it; to each process
        where they stayed in the test process's group."""
        for target, send in [(self.group, os.killpg)] if self.own_group else [(pid, os.kill) for pid in self.pids]:
            try:
                send(target, sig)
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
    return ForkedJob.ranks(args, nproc, cwd, env).wait(timeout)


def run_forked_process(
    args: list[str], timeout: float = 240, cwd: Path = ROOT, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """One `python -m spmd_rl.main ARGS` process (no launcher, no RANK) forked from the server, run to its end, as
    subprocess.run(command("none") + ARGS, capture_output=True, text=True) runs it. env: job_env() by default; it
    must pass forks_like_a_fresh_interpreter."""
    env = job_env() if env is None else env
    if not forks_like_a_fresh_interpreter(env):
        raise ValueError("a fork cannot start under this environment's PYTHON*/locale variables: start the command")
    return ForkedJob([str(arg) for arg in args], [env], cwd, own_group=False).wait(timeout)
