"""A warm interpreter that forks `python -m spmd_rl.main` ranks: tests/harness/forked.py's server (one per pytest
worker), run as a script, never imported.

A rank's process costs about 2 CPU seconds before its first line of spmd_rl runs, most of it importing torch; on the
2-core test machine that start-up is most of a multi-rank test. This interpreter imports once what every rank
imports, and each request forks a child that becomes a rank: its own process group (a job's ranks share one), its
working directory, environment, sys.path and output files, then spmd_rl.main run as __main__ (runpy), as
`python -m spmd_rl.main` runs it, and the interpreter's own exit (threads joined, atexit, flushed files).

Protocol (fd 0 in, fd 1 out, one JSON object per line): a request {"argv", "env", "cwd", "stdout", "stderr",
"group"} (group: the process group to join; 0 for a new one, the first rank's) is answered {"pid"}; every child's
end is reported as {"pid", "code"} (the exit code, or -N for signal N, as subprocess reports it).

What a fork does not give a rank that a fresh interpreter would: its own hash seed and numpy's legacy global random
state (both the server's). spmd_rl seeds what it draws from; ranks that must order a set of strings alike are
tested under torchrun and mpirun, which start fresh interpreters.
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import runpy
import select
import sys
import warnings

DEFAULT_WARNING_FILTERS = list(warnings.filters)  # the server starts without PYTHONWARNINGS (forked.py)


def _warm_up() -> None:
    """What every rank imports before its run (spmd_rl/main.py's order) and what every rank that builds the policy
    imports in its checks before start, and nothing more: FSDP's modules stay for the ranks that use them. Not
    spmd_rl.main itself: runpy runs it as __main__."""
    import torch  # noqa: F401

    from spmd_rl.config import loading  # noqa: F401
    from spmd_rl.runtime.fast_imports import import_tensordict_without_dynamo, optimizers_without_dynamo

    import_tensordict_without_dynamo()
    optimizers_without_dynamo()
    import gymnasium.envs.classic_control  # noqa: F401

    import spmd_rl.run.driver  # noqa: F401

    # Those ranks check the policy as fake tensors (run/contract.py), and FakeTensorMode imports torch._dynamo and
    # sympy: over half of a tiny colocated rank's CPU seconds. Imported after tensordict and the optimizers' patch,
    # as those ranks import it; an env rank, which skips the check, gets it too and uses nothing of it.
    for name in ("torch._subclasses.fake_tensor", "torch._dynamo"):
        importlib.import_module(name)


def _reply(message: dict) -> None:
    os.write(1, (json.dumps(message) + "\n").encode())  # unbuffered: a child inherits no pending reply


def _become_rank(request: dict) -> None:
    """In the forked child: the rank's process state, then spmd_rl.main as __main__. Ends with SystemExit (or an
    uncaught exception), which leaves the server's code and ends this interpreter as `python -m` would."""
    for fd, path in ((0, os.devnull), (1, request["stdout"]), (2, request["stderr"])):
        target = os.open(path, os.O_RDONLY) if fd == 0 else os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    _join_group(0, request["group"])
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    # sys.path as `python -m` builds it in cwd: the working directory, then PYTHONPATH, then the site's folders.
    own = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [request["cwd"], *own, *SITE_PATH]
    # Warning filters as a fresh interpreter sets them from PYTHONWARNINGS.
    sys.warnoptions[:] = [option for option in os.environ.get("PYTHONWARNINGS", "").split(",") if option]
    warnings.filters[:] = DEFAULT_WARNING_FILTERS
    warnings._processoptions(sys.warnoptions)
    sys.argv = ["-m", *request["argv"]]
    runpy.run_module("spmd_rl.main", run_name="__main__", alter_sys=True)
    sys.exit(0)


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
                _become_rank(request)  # never returns
            _join_group(pid, request["group"] or pid)
            _reply({"pid": pid})


if __name__ == "__main__":
    # The site's folders: this interpreter's path without its script folder and its own PYTHONPATH.
    started_with = {p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
    SITE_PATH = [p for p in sys.path[1:] if p not in started_with]
    _warm_up()
    # The warm-up's objects (torch's, dynamo's, sympy's: most of the heap) go to the collector's permanent
    # generation, so a rank's collections, and its interpreter's at exit, do not walk them all again (and copy every
    # page they touch from this process): a tiny colocated rank's user CPU went from about 1.2 s to 0.4 s.
    gc.freeze()
    serve()
