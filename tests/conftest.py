"""The test suite in four tiers, by what a test costs, over one harness (tests/harness/). Details: tests/README.md.

    tests/unit       no subprocess and no process group: pure functions, classes, configs, in-process checks
    tests/ranks      real gloo process groups forked inside the test (harness.multiproc.run_ranks)
    tests/runs       end-to-end runs of one process (`python -m spmd_rl.main`, spmd_rl.train, user-code subprocesses)
    tests/launchers  torchrun, mpirun and Slurm jobs, hand-started ranks, signals to jobs and injected faults

A test module goes in the tier of its most expensive test; split a module when a cheap part is worth having in a
faster tier. Modules import only from harness/ (never from another test module); their file names are unique across
tiers (pytest imports them by base name). Every test is marked with its tier, so `-m "not launchers"` works too.

Under pytest-xdist (`-n 2 --dist loadgroup`, as .ci/run runs it) the tests of a module with a module-scoped fixture
(a trained run, a Slurm cluster) stay on one worker, so the fixture is made once, and the modules that start real
Slurm daemons share one group, so no two throw-away clusters run at once. Every other test goes to whichever
worker is free, the units with a test marked slow first. The groups are handed to xdist's scheduler here
(pytest_xdist_make_scheduler), not as xdist_group marks: pytest-xdist 3.8 under pytest 9.2 drops those (it renames
`item._nodeid`, which pytest 9 no longer reads).

SIGINT is made catchable here if the suite was started with it ignored (a background job of a non-interactive
shell, as `cmd &` in a script or a CI runner may start it): every process the tests start would inherit the
ignored SIGINT, and bash cannot trap a signal ignored on entry, so launch/torchrun.sh would drop a Ctrl-C a test
sends it (test_rerun's torchrun-sigint case timed out that way). The tests model a job started from a terminal.
"""

from __future__ import annotations

import functools
import signal
from pathlib import Path

import pytest
from harness.launch import free_port as _free_port
from harness.launch import job_env as _job_env

if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:  # children get SIG_DFL: exec resets a handled signal
    signal.signal(signal.SIGINT, signal.default_int_handler)

TIERS = ("unit", "ranks", "runs", "launchers")
TESTS = Path(__file__).resolve().parent


def pytest_configure(config):
    for tier in TIERS:
        config.addinivalue_line("markers", f"{tier}: a test of the tests/{tier} tier (set by tests/conftest.py)")


@functools.cache
def _starts_slurm(module: Path) -> bool:
    """Whether a test module starts a throw-away Slurm cluster (slurmctld + slurmd, harness/slurm_cluster.py): those
    modules share one xdist group, so that two clusters never run at once."""
    return "slurm_cluster_fixture" in module.read_text()


@functools.cache
def _has_module_fixture(module: Path) -> bool:
    """Whether a test module defines a fixture made once for the module (or longer): its tests share one worker."""
    return any(f'scope="{scope}"' in module.read_text() for scope in ("module", "package", "session"))


def pytest_collection_modifyitems(config, items):
    for item in items:
        relative = Path(item.fspath).resolve().relative_to(TESTS)
        if relative.parts[0] in TIERS:
            item.add_marker(relative.parts[0])
    if hasattr(config, "workerinput") and getattr(config.option, "loadgroup", False):  # xdist's worker, loadgroup
        items[:] = slow_units_first(items, Path(config.rootpath))


def slow_units_first(items: list, root: Path) -> list:
    """The items with every unit xdist schedules (worker_group's group, else one test) that holds a test marked
    slow moved ahead of the rest, each unit's items and the units' order otherwise as collected. xdist hands out
    units in the order the workers collected them (after its groups of several tests), so the longest tests start
    first and neither worker is left idle at the end while the other runs one of them."""
    units = [worker_group(item.nodeid, root) or item.nodeid for item in items]
    slow = {unit for unit, item in zip(units, items) if item.get_closest_marker("slow")}
    return [item for unit, item in sorted(zip(units, items), key=lambda pair: pair[0] not in slow)]


def worker_group(nodeid: str, root: Path) -> str | None:
    """The group a test shares a worker with: "slurm" for the modules that start a Slurm cluster, the module's path
    for a module with a module fixture; None for a test that may go anywhere."""
    module = (root / nodeid.split("::")[0]).resolve()
    if not module.is_file():
        return None
    if _starts_slurm(module):
        return "slurm"
    if _has_module_fixture(module):
        return module.relative_to(TESTS).as_posix()
    return None


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which would build its mark-based scheduler
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    root = Path(config.rootpath)

    class ModuleFixtureGroups(LoadScopeScheduling):
        """xdist's scope scheduling with worker_group as the scope: a group's tests go to one worker as one unit
        (the largest units first), every other test is a unit of its own."""

        def _split_scope(self, nodeid: str) -> str:
            return worker_group(nodeid, root) or nodeid

    return ModuleFixtureGroups(config, log)


@pytest.fixture
def job_env() -> dict[str, str]:
    """The environment for a job's processes (gloo on loopback, unbuffered, no inherited RANK)."""
    return _job_env()


@pytest.fixture
def free_port() -> int:
    """A loopback port that was free a moment ago."""
    return _free_port()
