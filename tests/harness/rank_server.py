"""A warm interpreter that forks `python -m spmd_rl.main` processes (a job's ranks, or one process without a
launcher): tests/harness/forked.py's server (one per pytest worker), run as a script, never imported.

A process costs about 2 CPU seconds before its first line of spmd_rl runs, most of it importing torch; on the
2-core test machine that start-up is most of a short test. This interpreter imports once what every process
imports, and each request forks a child that becomes the process: its own process group (a job's ranks share one),
its working directory, environment, sys.path, output files and stdin (/dev/null), then the module (spmd_rl.main)
run as __main__ (runpy), as `python -m` runs it, and the interpreter's own exit (threads joined, atexit, flushed
files).

What the server set up that a fresh interpreter would have differently is set again in the child: the sizes of
torch's intra-op pool and numpy's OpenBLAS pool (the request's, which forked.py reads from a fresh interpreter in
the request's environment: the server runs on one thread, thread_pools.py), torch's and numpy's global random
state (reseeded from the OS, as a fresh interpreter seeds them; Python's random module reseeds itself after a
fork), the warning filters (from the request's PYTHONWARNINGS, the imports' own in front, the registries of
warnings already shown cleared), the variables the imports put in the environment, and sys.path (made absolute,
without repeats, as site.py leaves it). tests/runs/test_forked_process.py compares a child with a fresh
interpreter.

Protocol (fd 0 in, fd 1 out, one JSON object per line): a request {"argv", "env", "cwd", "stdout", "stderr",
"group", "module", "threads"} (group: the process group to join; 0 for a new one, the first rank's; -1 to stay in
the server's, which is its test process's, as a child of subprocess.run does) is answered {"pid"}; every child's
end is reported as {"pid", "code"} (the exit code, or -N for signal N, as subprocess reports it).

What a fork does not give a child that a fresh interpreter would: its own hash seed (every child has the
server's); what an interpreter reads from the environment only as it starts or loads torch (PYTHON*, the locale's,
TORCH*, the thread runtimes' but the thread counts: forked.py starts the real command where a request's differ); and
it has modules the server imported that the process might import later or not at all (torch._dynamo and sympy,
which a run's checks before start import). spmd_rl seeds what it draws from; ranks that must order a set of strings
alike are tested under torchrun and mpirun, which start fresh interpreters.
"""

from __future__ import annotations

import gc
import json
import os
import runpy
import select
import sys
import warnings

from thread_pools import set_thread_counts  # this script's folder
from warm_imports import warm_up

DEFAULT_WARNING_FILTERS = list(warnings.filters)  # the server starts without PYTHONWARNINGS (forked.py)


def _reply(message: dict) -> None:
    os.write(1, (json.dumps(message) + "\n").encode())  # unbuffered: a child inherits no pending reply


def _become_process(request: dict) -> None:
    """In the forked child: the process's state, then the module (spmd_rl.main) as __main__. Ends with SystemExit
    (or an uncaught exception), which leaves the server's code and ends this interpreter as `python -m` would."""
    for fd, path in ((0, os.devnull), (1, request["stdout"]), (2, request["stderr"])):
        target = os.open(path, os.O_RDONLY) if fd == 0 else os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    if request["group"] >= 0:
        _join_group(0, request["group"])
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for name, value in IMPORTED_ENVIRONMENT.items():  # as the warm-up's imports set them where they were unset
        os.environ.setdefault(name, value)
    # sys.path as `python -m` builds it in cwd: the working directory, then PYTHONPATH, then the site's folders.
    # site.py makes those absolute and drops repeats (not the working directory, put in front after it).
    own = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [request["cwd"], *dict.fromkeys(os.path.abspath(p) for p in [*own, *SITE_PATH])]
    # Warning filters as a fresh interpreter sets them from PYTHONWARNINGS, then the warm-up's imports add theirs
    # in front (torch's, numpy's), as they would have on their import.
    sys.warnoptions[:] = [option for option in os.environ.get("PYTHONWARNINGS", "").split(",") if option]
    warnings.filters[:] = DEFAULT_WARNING_FILTERS
    warnings._processoptions(sys.warnoptions)
    warnings.filters[:0] = IMPORTED_WARNING_FILTERS
    warnings._filters_mutated()  # a warning the server showed once is shown again, as by a fresh interpreter
    _fresh_global_state(request["threads"])
    for name in ("thread_pools", "warm_imports"):  # the server's own: a module of the process may take the names
        sys.modules.pop(name, None)
    sys.argv = ["-m", *request["argv"]]
    runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    sys.exit(0)


def _fresh_global_state(threads: dict) -> None:
    """The thread pools' sizes and torch's and numpy's global generators as a fresh interpreter starts them."""
    import numpy
    import torch

    set_thread_counts(threads)
    torch.seed()  # a fresh interpreter seeds torch's default generator from the OS
    numpy.random.seed()  # and numpy's legacy global state


def _join_group(pid: int, group: int) -> None:
    """Both the server and the child set the child's process group (the usual way to close the race between the
    two): a job's next rank may join the group only once it exists."""
    try:
        os.setpgid(pid, group)
    except (PermissionError, ProcessLookupError):  # the other side was first (or the child has ended)
        pass


def _reap() -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if not pid:
            return
        _reply({"pid": pid, "code": os.waitstatus_to_exitcode(status)})


def serve() -> None:
    pending = b""
    while True:
        ready, _, _ = select.select([0], [], [], 0.02)
        _reap()
        if not ready:
            continue
        chunk = os.read(0, 65536)
        if not chunk:  # the test process is gone: the children are its jobs' ranks, which it kills itself
            return
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            pid = os.fork()
            if pid == 0:
                _become_process(request)  # never returns
            if request["group"] >= 0:
                _join_group(pid, request["group"] or pid)
            _reply({"pid": pid})


if __name__ == "__main__":
    # The site's folders: this interpreter's path without its script folder and its own PYTHONPATH.
    started_with = {p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
    SITE_PATH = [p for p in sys.path[1:] if p not in started_with]
    environment_before = dict(os.environ)
    # The warm-up imports spmd_rl as `python -m spmd_rl.main` in the repository does: from the working directory (the
    # repository), not from an installed copy. A script's path starts with its own folder instead, and a venv's
    # editable install may point at another checkout (a worktree's tests ran the main checkout's code).
    sys.path.insert(0, os.getcwd())
    warm_up()
    del sys.path[0]
    # What the imports put in the environment (PYGAME_HIDE_SUPPORT_PROMPT, TORCHINDUCTOR_CACHE_DIR): a child's own
    # environment replaces the server's, and its imports would have set these.
    IMPORTED_ENVIRONMENT = {k: v for k, v in os.environ.items() if environment_before.get(k) != v}
    # The filters the warm-up's imports put in front of the defaults (where `simplefilter` puts them).
    if warnings.filters[len(warnings.filters) - len(DEFAULT_WARNING_FILTERS) :] != DEFAULT_WARNING_FILTERS:
        raise SystemExit("rank_server.py: an import changed the default warning filters; a child cannot restore them")
    IMPORTED_WARNING_FILTERS = warnings.filters[: len(warnings.filters) - len(DEFAULT_WARNING_FILTERS)]
    # The warm-up's objects (torch's, dynamo's, sympy's: most of the heap) go to the collector's permanent
    # generation, so a rank's collections, and its interpreter's at exit, do not walk them all again (and copy every
    # page they touch from this process): a tiny colocated rank's user CPU went from about 1.2 s to 0.4 s.
    gc.freeze()
    serve()
