"""The one place the tests and benchmarks spell a launch line: no launcher, torchrun or mpirun, and their env.

    subprocess.run(command("torchrun", 2) + ["--config", TINY], cwd=ROOT, env=job_env())

Only the standard library: benchmarks/ import this module too (with tests/ on sys.path), without pytest.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository
PYTHON = sys.executable
LAUNCHERS = ("none", "torchrun", "mpirun")


def free_ports(count: int) -> list[int]:
    """count distinct loopback ports that were free a moment ago (held together, so no two are the same)."""
    probes = [socket.socket() for _ in range(count)]
    try:
        for probe in probes:
            probe.bind(("127.0.0.1", 0))
        return [probe.getsockname()[1] for probe in probes]
    finally:
        for probe in probes:
            probe.close()


def free_port() -> int:
    return free_ports(1)[0]


def job_env(**variables: str) -> dict[str, str]:
    """This process's environment for a job's ranks: gloo on loopback, unbuffered output (a test reads the lines
    of a rank that is killed), no RANK inherited from an outer launcher; `variables` added last."""
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1")
    env.pop("RANK", None)
    env.update(variables)
    return env


def rank_env(rank: int, world: int, port: int, **variables: str) -> dict[str, str]:
    """job_env for one rank of a job started by hand, without a launcher agent (so only the framework decides how
    the job ends): the variables torchrun would set on one host, the store on port."""
    hand_set = dict(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    return job_env(**hand_set, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **variables)


def with_pythonpath(env: dict[str, str], *folders: Path | str) -> dict[str, str]:
    """env with folders put first on PYTHONPATH (what it had before stays after them)."""
    paths = [str(folder) for folder in folders] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**env, "PYTHONPATH": os.pathsep.join(paths)}


def command(
    launcher: str = "none",
    nproc: int = 1,
    *,
    module: str = "spmd_rl.main",
    script: str | Path | None = None,
    standalone: bool = False,
    launcher_args: tuple[str, ...] | list[str] = (),
) -> list[str]:
    """The command line that starts `python -m module` (or `python script`) as nproc ranks on this host.

    none:     one process, no launcher (nproc must be 1)
    torchrun: `python -m torch.distributed.run` (the venv's torchrun, whatever PATH holds); a c10d rendezvous on a
              free loopback port, or torchrun's own `--standalone` (the line a user types)
    mpirun:   Open MPI's mpirun, allowed to run as root (CI does), oversubscribed and unbound (2 cores, more ranks)
    launcher_args go after the launcher's own options (for example `--max-restarts=1`).
    """
    program = [PYTHON, str(script)] if script is not None else [PYTHON, "-m", module]
    if launcher == "none":
        if nproc != 1:
            raise ValueError(f"launcher 'none' starts one process, not {nproc}")
        return program
    if launcher == "torchrun":
        if standalone:
            rendezvous = ["--standalone"]
        else:
            rendezvous = ["--nnodes=1", "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{free_port()}"]
        tail = [str(script)] if script is not None else ["-m", module]  # torchrun starts its own python
        return [PYTHON, "-m", "torch.distributed.run", *rendezvous, f"--nproc_per_node={nproc}", *launcher_args, *tail]
    if launcher == "mpirun":
        options = ["--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-n", str(nproc)]
        return ["mpirun", *options, *launcher_args, *program]
    raise ValueError(f"launcher {launcher!r}: expected one of {', '.join(LAUNCHERS)}")
