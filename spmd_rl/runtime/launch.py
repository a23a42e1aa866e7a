"""How was this process started? Each launch source reads the environment it leaves behind.

Sources are tried in precedence order; the first one whose variables are present wins:
  1. torchrun   RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT (also under `srun torchrun`, whose workers
                inherit the agent's SLURM_PROCID: RANK must win over Slurm's variables); the same variables set by
                hand, without torchrun's agent (no TORCHELASTIC_RUN_ID), are launcher "env"
  2. mpi        OMPI_COMM_WORLD_RANK, PMIX_RANK or PMI_RANK (mpirun / mpiexec, also inside a Slurm allocation,
                whose SLURM_PROCID the ranks inherit). Rank, size and local rank come from mpi4py; rank 0 picks
                the address and a free port and broadcasts them (as plain bytes: nothing is unpickled).
  3. slurm      SLURM_PROCID + SLURM_NTASKS + SLURM_LOCALID + a node list inside an srun step (SLURM_STEP_ID):
                `srun` with one task per rank. The master is the first host of the step's node list, the port
                20000 + SLURM_JOB_ID % 12000; MASTER_ADDR / MASTER_PORT override both. A batch script has
                SLURM_PROCID but no step: a program started there without srun is a single process.
  4. none       no launcher: one process, world size 1, no process group needed
A source that finds some of its variables but not all raises a UserError naming the missing ones.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from spmd_rl.runtime.errors import UserError


@dataclass(frozen=True)
class LaunchInfo:
    launcher: str  # "torchrun", "env" (torchrun's variables set by hand), "mpi", "slurm" or "none"
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    init_method: str  # URL for torch.distributed.init_process_group ("" when world_size == 1)

    @property
    def distributed(self) -> bool:
        return self.world_size > 1 or self.launcher != "none"


def _int_var(env: Mapping[str, str], name: str, launcher: str) -> int:
    text = env[name]
    try:
        return int(text)
    except ValueError:
        raise UserError(f"{launcher} launch: environment variable {name}={text!r} is not an integer") from None


def _require(env: Mapping[str, str], names: tuple[str, ...], launcher: str) -> None:
    missing = [n for n in names if n not in env]
    if missing:
        present = [n for n in names if n in env]
        raise UserError(
            f"{launcher} launch detected ({', '.join(present)} set) but {', '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} missing; launch with {launcher} as documented "
            f"in docs/launching.md or unset the partial variables"
        )


def _check_rank(rank: int, world_size: int, local_rank: int, launcher: str) -> None:
    if world_size < 1 or not 0 <= rank < world_size or local_rank < 0:
        raise UserError(
            f"{launcher} launch: rank {rank}, world size {world_size}, local rank {local_rank} are "
            f"contradictory (need 0 <= rank < world size)"
        )


def from_torchrun(env: Mapping[str, str]) -> LaunchInfo | None:
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    if "RANK" not in env and "WORLD_SIZE" not in env:
        return None
    _require(env, names, "torchrun")
    rank = _int_var(env, "RANK", "torchrun")
    world = _int_var(env, "WORLD_SIZE", "torchrun")
    local = _int_var(env, "LOCAL_RANK", "torchrun")
    _check_rank(rank, world, local, "torchrun")
    local_world = _int_var(env, "LOCAL_WORLD_SIZE", "torchrun") if "LOCAL_WORLD_SIZE" in env else world
    launcher = "torchrun" if "TORCHELASTIC_RUN_ID" in env else "env"  # the agent sets it for every worker
    return LaunchInfo(launcher, rank, world, local, local_world, "env://")


# Variables an MPI launcher sets for each process, with the matching world-size variable (None: not standard).
MPI_RANK_VARIABLES = (
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),  # Open MPI
    ("PMIX_RANK", None),  # PMIx (Open MPI 5, srun --mpi=pmix)
    ("PMI_RANK", "PMI_SIZE"),
)  # MPICH / Intel MPI (Hydra), PMI-2


def mpi_rank_from_env(env: Mapping[str, str]) -> tuple[str, int, int | None] | None:
    """(variable, rank, world size or None) as the MPI launcher announced them, or None without an MPI launcher.

    mpi4py is the authority on rank and size; these values only detect the launch and cross-check mpi4py.
    """
    for rank_name, size_name in MPI_RANK_VARIABLES:
        if rank_name in env:
            rank = _int_var(env, rank_name, "mpi")
            size = _int_var(env, size_name, "mpi") if size_name and size_name in env else None
            if rank < 0 or (size is not None and not rank < size):
                size_text = f" with {size_name}={size}" if size is not None else ""
                raise UserError(f"mpi launch: {rank_name}={rank} is contradictory{size_text} (need 0 <= rank < size)")
            return rank_name, rank, size
    return None


def from_mpi(env: Mapping[str, str]) -> LaunchInfo | None:
    announced = mpi_rank_from_env(env)
    if announced is None:
        return None
    rank_name, env_rank, env_size = announced
    try:
        from mpi4py import MPI  # imported only here: initializing MPI outside an MPI launch is slow or fails
    except ImportError as exc:
        raise UserError(
            f"mpi launch detected ({rank_name} set) but mpi4py cannot be imported ({exc}); pip install mpi4py"
        ) from None
    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    if rank != env_rank or (env_size is not None and world != env_size):
        # Typical cause: mpi4py's MPI library is not the one whose mpirun started us, so every process is a
        # singleton (rank 0 of 1).
        raise UserError(
            f"mpi launch: the launcher says {rank_name}={env_rank}"
            f"{f' of {env_size}' if env_size is not None else ''} but mpi4py's COMM_WORLD says rank "
            f"{rank} of {world} ({MPI.Get_library_version().splitlines()[0].strip()}); launch with the "
            f"mpirun of the MPI that mpi4py uses"
        )
    node_comm = comm.Split_type(MPI.COMM_TYPE_SHARED)
    local_rank, local_world = node_comm.Get_rank(), node_comm.Get_size()
    node_comm.Free()
    url, error = "", ""
    if rank == 0:
        try:
            url = _mpi_rendezvous_url(env, single_host=local_world == world)
        except UserError as exc:  # tell the other ranks too: they are about to wait for rank 0's address
            error = str(exc)
    ok, text = _mpi_broadcast_text(comm, not error, error or url)
    if not ok:
        raise UserError(text if rank == 0 else f"mpi launch: rank 0 could not choose a rendezvous address: {text}")
    return LaunchInfo("mpi", rank, world, local_rank, local_world, text)


MPI_TEXT_BYTES = 4096  # the longest text _mpi_broadcast_text carries (a URL or an error message)


def _mpi_broadcast_text(comm, ok: bool, text: str) -> tuple[bool, str]:
    """Rank 0's (ok, text) on every rank, sent with one Bcast of a fixed-size byte buffer: a status byte, a 4-byte
    length, UTF-8. Plain bytes, unlike comm.bcast, which unpickles whatever rank 0 sent."""
    import numpy as np

    buffer = np.zeros(5 + MPI_TEXT_BYTES, dtype=np.uint8)
    if comm.Get_rank() == 0:
        data = text.encode()[:MPI_TEXT_BYTES]  # only an error message can be this long; cut, it stays readable
        buffer[0] = ok
        buffer[1:5] = np.frombuffer(len(data).to_bytes(4, "little"), dtype=np.uint8)
        buffer[5 : 5 + len(data)] = np.frombuffer(data, dtype=np.uint8)
    comm.Bcast(buffer, root=0)
    length = int.from_bytes(buffer[1:5].tobytes(), "little")
    return bool(buffer[0]), buffer[5 : 5 + length].tobytes().decode(errors="replace")


def _mpi_rendezvous_url(env: Mapping[str, str], single_host: bool) -> str:
    """Rank 0's address and a port nobody is listening on, unless MASTER_ADDR / MASTER_PORT say otherwise."""
    if "MASTER_ADDR" in env:
        addr = env["MASTER_ADDR"]
    elif single_host:
        addr = "127.0.0.1"
    else:
        addr = socket.gethostbyname(socket.gethostname())
        if addr.startswith("127."):
            raise UserError(
                f"mpi launch across hosts: this host's name {socket.gethostname()!r} resolves to "
                f"loopback {addr}, which other hosts cannot reach; set MASTER_ADDR to an address of "
                f"rank 0's host (e.g. mpirun -x MASTER_ADDR=...)"
            )
    port = _int_var(env, "MASTER_PORT", "mpi") if "MASTER_PORT" in env else _free_port()
    return f"tcp://{addr}:{port}"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand Slurm's compressed host list: "node[01-03,07],gpu5" -> node01 node02 node03 node07 gpu5.

    Ranges keep their zero padding; several bracket groups in one name multiply ("r[1-2]n[1-2]" -> 4 hosts).
    """
    hosts: list[str] = []
    for item in _split_top_level(nodelist.strip()):
        expanded = [""]
        for literal, bracket in re.findall(r"([^\[\]]*)(?:\[([^\]]*)\])?", item):
            if not literal and not bracket:
                continue
            expanded = [prefix + literal + suffix for prefix in expanded for suffix in _expand_ranges(bracket, item)]
        hosts.extend(expanded)
    if not hosts or any(not host for host in hosts):
        raise UserError(f"slurm launch: cannot read the node list {nodelist!r}")
    return hosts


def _split_top_level(nodelist: str) -> list[str]:
    """Split at commas outside brackets: "a[1,3],b" -> ["a[1,3]", "b"]."""
    items, depth, start = [], 0, 0
    for i, char in enumerate(nodelist):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth not in (0, 1):
            raise UserError(f"slurm launch: unbalanced brackets in the node list {nodelist!r}")
        if char == "," and depth == 0:
            items.append(nodelist[start:i])
            start = i + 1
    if depth != 0:
        raise UserError(f"slurm launch: unbalanced brackets in the node list {nodelist!r}")
    items.append(nodelist[start:])
    return items


def _expand_ranges(bracket: str, item: str) -> list[str]:
    if not bracket:
        return [""]
    values: list[str] = []
    for part in bracket.split(","):
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", part.strip())
        if match is None:
            raise UserError(f"slurm launch: cannot read the range [{bracket}] in the node list item {item!r}")
        first, last = match.group(1), match.group(2) or match.group(1)
        values.extend(str(n).zfill(len(first)) for n in range(int(first), int(last) + 1))
    return values


def expand_tasks_per_node(text: str) -> list[int]:
    """Expand Slurm's tasks-per-node list: "2(x3),1" -> [2, 2, 2, 1]."""
    counts = []
    for part in text.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            raise UserError(f"slurm launch: cannot read the tasks-per-node list {text!r}")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


SLURM_NODELIST_VARIABLES = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")  # the step's nodes first
SLURM_TASKS_PER_NODE_VARIABLES = ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE")


def slurm_default_port(job_id: int) -> int:
    """The port every task of a job derives on its own; launch scripts use the same rule. 20000-31999: below
    Linux's ephemeral ports (32768 and up), which any outgoing connection on the node may hold at that moment."""
    return 20000 + job_id % 12000


def from_slurm(env: Mapping[str, str]) -> LaunchInfo | None:
    # The batch script itself also has SLURM_PROCID=0 and the job's SLURM_NTASKS, but no step id: a program
    # started there without srun is one process, not rank 0 of a world whose other ranks never start.
    if "SLURM_PROCID" not in env or not ("SLURM_STEP_ID" in env or "SLURM_STEPID" in env):
        return None
    _require(env, ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"), "slurm")
    nodelist_name = next((name for name in SLURM_NODELIST_VARIABLES if name in env), None)
    if nodelist_name is None:
        raise UserError(
            "slurm launch detected (SLURM_PROCID set) but none of "
            f"{', '.join(SLURM_NODELIST_VARIABLES)} is set; start the ranks with srun"
        )
    rank = _int_var(env, "SLURM_PROCID", "slurm")
    world = _int_var(env, "SLURM_NTASKS", "slurm")
    local_rank = _int_var(env, "SLURM_LOCALID", "slurm")
    _check_rank(rank, world, local_rank, "slurm")
    hosts = expand_nodelist(env[nodelist_name])
    local_world = _slurm_local_world_size(env, hosts, world)
    if not local_rank < local_world:
        raise UserError(f"slurm launch: SLURM_LOCALID={local_rank} but this node runs {local_world} tasks")
    addr = env.get("MASTER_ADDR", hosts[0])
    if "MASTER_PORT" in env:
        port = _int_var(env, "MASTER_PORT", "slurm")
    elif "SLURM_JOB_ID" in env:
        port = slurm_default_port(_int_var(env, "SLURM_JOB_ID", "slurm"))
    else:
        raise UserError(
            "slurm launch detected (SLURM_PROCID set) but neither SLURM_JOB_ID nor MASTER_PORT is set, "
            "so the ranks cannot agree on a port; start the ranks with srun or set MASTER_PORT"
        )
    return LaunchInfo("slurm", rank, world, local_rank, local_world, f"tcp://{addr}:{port}")


def _slurm_local_world_size(env: Mapping[str, str], hosts: list[str], world: int) -> int:
    name = next((name for name in SLURM_TASKS_PER_NODE_VARIABLES if name in env), None)
    if name is None:
        if len(hosts) == 1:
            return world
        raise UserError(
            f"slurm launch on {len(hosts)} nodes but none of {', '.join(SLURM_TASKS_PER_NODE_VARIABLES)}"
            f" is set; start the ranks with srun"
        )
    counts = expand_tasks_per_node(env[name])
    node = _int_var(env, "SLURM_NODEID", "slurm") if "SLURM_NODEID" in env else 0
    # SLURM_NTASKS_PER_NODE is one number for every node; the other two list each node.
    return counts[0] if len(counts) == 1 else counts[min(node, len(counts) - 1)]


def single_process(env: Mapping[str, str]) -> LaunchInfo:
    return LaunchInfo("none", 0, 1, 0, 1, "")


# Precedence order (see the module docstring); single_process is the fallback after all of them.
LAUNCH_SOURCES: list[Callable[[Mapping[str, str]], LaunchInfo | None]] = [from_torchrun, from_mpi, from_slurm]


def detect_launch(env: Mapping[str, str] | None = None) -> LaunchInfo:
    env = os.environ if env is None else env
    for source in LAUNCH_SOURCES:
        info = source(env)
        if info is not None:
            return info
    return single_process(env)


def rank_from_env(env: Mapping[str, str] | None = None) -> int | None:
    """The rank a launcher announced, read without starting anything (no mpi4py), or None without one.

    For deciding who speaks before the launch is detected (a config error is the same on every rank, so rank 0
    alone prints it). The precedence is detect_launch's; a value that is not an integer reads as None, so that
    the process still speaks.
    """
    env = os.environ if env is None else env
    names = ("RANK", *(rank_name for rank_name, _ in MPI_RANK_VARIABLES), "SLURM_PROCID")
    name = next((name for name in names if name in env), None)
    if name is None:
        return None
    try:
        return int(env[name])
    except ValueError:
        return None


def world_size_from_env(env: Mapping[str, str] | None = None) -> int | None:
    """The world size the launcher that rank_from_env reads announced, or None without one (or not an integer)."""
    env = os.environ if env is None else env
    names = (("RANK", "WORLD_SIZE"), *MPI_RANK_VARIABLES, ("SLURM_PROCID", "SLURM_NTASKS"))
    size = next((size for rank, size in names if rank in env), None)
    try:
        return None if size is None else int(env[size])
    except (KeyError, ValueError):
        return None
