"""`python -m tests.harness.process_probe CODE [ARGS]`: prints, as one JSON line, the process state a warm fork
must give a process as a fresh interpreter would (tests/runs/test_forked_process.py compares the two), warns twice
with one warning, writes a line to stderr and exits with CODE. It first imports what the warm interpreter has
(warm_imports.py), as a run of spmd_rl.main has by its checks before start: filters and state that imports set
are compared after the same imports."""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import random
import signal
import sys
import warnings

import numpy
import torch

from tests.harness.thread_pools import thread_counts
from tests.harness.warm_imports import warm_up


def _state() -> dict:
    return {
        "argv": sys.argv[1:],
        "argv0": sys.argv[0],
        "name": __name__,
        "spec": __spec__.name if __spec__ is not None else None,
        "cwd": os.getcwd(),
        "env": dict(os.environ),
        "path": sys.path,
        # where the warm-up's spmd_rl came from: the repository's own (the working directory's, as `python -m` in it
        # imports), not an installed one; a venv's editable install may point at another checkout
        "spmd_rl": sys.modules["spmd_rl"].__file__,
        "threads": thread_counts(),
        "interop_threads": torch.get_num_interop_threads(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "default_dtype": str(torch.get_default_dtype()),
        "grad_enabled": torch.is_grad_enabled(),
        "warnoptions": sys.warnoptions,
        "warning_filters": [repr(f) for f in warnings.filters],
        "logging": [logging.getLogger().level, [repr(h) for h in logging.getLogger().handlers]],
        "signals": {s.name: repr(signal.getsignal(s)) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)},
        "blocked": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
        "process_group": os.getpgrp(),
        "stdin": os.path.realpath(f"/proc/self/fd/{sys.stdin.fileno()}") if sys.stdin else None,
        "stdout": [sys.stdout.encoding, sys.stdout.errors, sys.stdout.line_buffering, sys.stdout.write_through],
        "stderr": [sys.stderr.encoding, sys.stderr.errors, sys.stderr.line_buffering, sys.stderr.write_through],
        "flags": repr(sys.flags),
        "umask": os.umask(os.umask(0)),
        "start_method": multiprocessing.get_start_method(allow_none=True),
        # drawn from each global generator: equal in two processes only if they start from one state
        "draws": [torch.rand(1).item(), float(numpy.random.rand()), random.random(), torch.initial_seed()],
    }


if __name__ == "__main__":
    warm_up()
    print(json.dumps(_state()))
    for _ in range(2):
        warnings.warn("the probe's warning", UserWarning, stacklevel=1)
    print("the probe's stderr line", file=sys.stderr)
    sys.exit(int(sys.argv[1]))
