"""The thread pools a process's numbers run on, which an interpreter sizes from the environment as it loads them
(OMP_NUM_THREADS, MKL_NUM_THREADS, OPENBLAS_NUM_THREADS, ...): torch's intra-op threads and the OpenBLAS numpy
loaded. The warm interpreter (rank_server.py) loads both on one thread; a child it forks sets the counts a fresh
interpreter would have (forked.py reads them from one, `python thread_pools.py`), and process_probe.py reports
them. Standard library, numpy and torch only."""

from __future__ import annotations

import ctypes
import json

# OpenBLAS's thread-count functions: numpy's own build (scipy-openblas, 64-bit ints), then a plain OpenBLAS
_GET = ("scipy_openblas_get_num_threads64_", "openblas_get_num_threads")
_SET = ("scipy_openblas_set_num_threads64_", "openblas_set_num_threads")


def _openblas() -> ctypes.CDLL | None:
    import numpy  # noqa: F401  (loads its OpenBLAS)

    with open("/proc/self/maps") as maps:
        paths = sorted({line.split()[-1] for line in maps if "openblas" in line.rsplit("/", 1)[-1].lower()})
    return ctypes.CDLL(paths[0]) if paths else None


def _function(library: ctypes.CDLL | None, names: tuple[str, ...]):
    return next((getattr(library, name) for name in names if hasattr(library, name)), None)


def thread_counts() -> dict[str, int | None]:
    import torch

    get = _function(_openblas(), _GET)
    return {"torch": torch.get_num_threads(), "openblas": get() if get is not None else None}


def set_thread_counts(counts: dict[str, int | None]) -> None:
    import torch

    torch.set_num_threads(counts["torch"])
    set_ = _function(_openblas(), _SET)
    if set_ is not None and counts["openblas"] is not None:
        set_(counts["openblas"])


if __name__ == "__main__":
    print(json.dumps(thread_counts()))
