"""A throw-away Slurm cluster on this host, for tests: real slurmctld and slurmd daemons, no systemd, no munge.

    @pytest.fixture(scope="module")
    def slurm(tmp_path_factory):
        yield from slurm_cluster_fixture(tmp_path_factory, node_count=2)

slurm.conf is generated at run time (the host name and the free ports differ per machine) into a temporary
directory, along with the state, spool, log and pid files. With node_count > 1 each "node" is its own slurmd
(`slurmd -N n<i>`) with its own port, all on 127.0.0.1, so multi-node jobs run on one machine. The daemons are
stopped by their pid files at the end, also when a test failed. Tests skip when the Slurm binaries are absent
(.ci/install-system.sh installs them).

With preemption=True the node is in two partitions: `low` (the default; its jobs can be preempted, and requeued,
after a grace time) and `high` (a job there preempts low's jobs when the CPUs do not suffice for both).
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from harness.launch import free_ports

SLURM_BINARIES = ("slurmctld", "slurmd", "sbatch", "srun", "squeue", "scontrol")
CPUS_PER_NODE = 8  # more than this machine has: SlurmdParameters=config_overrides lets a node claim them
FINISHED_STATES = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "PREEMPTED",
    "BOOT_FAIL",
    "DEADLINE",
}


def missing_slurm_binaries() -> list[str]:
    return [name for name in SLURM_BINARIES if shutil.which(name) is None]


@dataclass
class JobResult:
    job_id: str
    state: str
    exit_code: str  # "0:0" = exit status 0, no signal
    output: str  # the batch script's stdout and stderr


@dataclass
class SlurmCluster:
    root: Path
    conf: Path
    nodes: list[str]
    pid_files: list[Path] = field(default_factory=list)

    @property
    def env(self) -> dict[str, str]:
        """This process's environment pointed at this cluster (sbatch exports it to the job)."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def run(self, *args: str, timeout: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run(args, env=self.env, capture_output=True, text=True, timeout=timeout)

    def submit(
        self,
        script: str | Path,
        *args: str,
        sbatch_options: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
    ) -> str:
        """sbatch a script; returns the job id."""
        output = self.root / "job-%j.out"
        done = subprocess.run(
            ["sbatch", "--parsable", f"--output={output}", *sbatch_options, str(script), *args],
            env={**self.env, **(env or {})},
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=30,
        )
        if done.returncode != 0:
            raise RuntimeError(f"sbatch failed ({done.returncode}): {done.stderr.strip()}")
        return done.stdout.strip().split(";")[0]

    def wait_job(self, job_id: str, timeout: float) -> JobResult:
        """Poll squeue until the job left the queue (sbatch --wait returns late), then read its final state."""
        deadline = time.monotonic() + timeout
        while self.run("squeue", "-h", "-j", job_id).stdout.strip():
            if time.monotonic() > deadline:
                self.run("scancel", job_id)
                raise TimeoutError(
                    f"slurm job {job_id} still queued or running after {timeout:.0f} s; cancelled.\n"
                    f"{self.job_output(job_id)}"
                )
            time.sleep(0.5)
        fields = self.job_fields(job_id)
        return JobResult(job_id, fields.get("JobState", "?"), fields.get("ExitCode", "?"), self.job_output(job_id))

    def job_fields(self, job_id: str) -> dict[str, str]:
        """`scontrol show job`'s KEY=VALUE fields (JobState, Restarts, PreemptTime, ...)."""
        return dict(
            item.split("=", 1)
            for item in self.run("scontrol", "-o", "show", "job", job_id).stdout.split()
            if "=" in item
        )

    def job_output(self, job_id: str) -> str:
        path = self.root / f"job-{job_id}.out"
        return path.read_text() if path.exists() else f"(no output file {path})"

    def logs(self) -> str:
        """The daemons' logs, for a failing test's message."""
        return "\n".join(f"--- {path.name}\n{path.read_text()[-3000:]}" for path in sorted(self.root.glob("*.log")))


# A preempted job gets this long between its SIGTERM and its SIGKILL: far more than a checkpoint of the tiny config.
PREEMPT_GRACE_S = 60


def write_slurm_conf(root: Path, node_count: int, preemption: bool = False) -> tuple[Path, list[str]]:
    """A minimal slurm.conf for one host: root runs everything, no cgroups, no accounting, no munge."""
    host = socket.gethostname().split(".")[0]
    controller_port, *node_ports = free_ports(1 + node_count)
    # One node is the host itself (its name resolves, as on a real cluster); several are emulated as n1, n2, ...
    nodes = [host] if node_count == 1 else [f"n{i + 1}" for i in range(node_count)]
    node_lines = [
        f"NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} CPUs={CPUS_PER_NODE} State=UNKNOWN"
        for name, port in zip(nodes, node_ports)
    ]
    partition = f"Nodes={','.join(nodes)} MaxTime=INFINITE State=UP"
    if preemption:
        # No oversubscription: a job in `high` that needs CPUs a `low` job holds preempts it (SIGTERM to the job's
        # steps, then SIGKILL and a requeue after the grace time).
        partition_lines = [
            "PreemptType=preempt/partition_prio",
            "PreemptMode=REQUEUE",
            f"PartitionName=low {partition} Default=YES PriorityTier=1 OverSubscribe=NO "
            f"PreemptMode=REQUEUE GraceTime={PREEMPT_GRACE_S}",
            f"PartitionName=high {partition} Default=NO PriorityTier=2 OverSubscribe=NO",
        ]
    else:
        partition_lines = [f"PartitionName=test {partition} Default=YES OverSubscribe=YES"]
    conf = root / "slurm.conf"
    conf.write_text(
        "\n".join(
            [
                "ClusterName=spmd-rl-test",
                f"SlurmctldHost={host}(127.0.0.1)",
                f"SlurmctldPort={controller_port}",
                "SlurmUser=root",
                "SlurmdUser=root",
                "AuthType=auth/none",
                "CredType=cred/none",
                "MpiDefault=none",
                "ProctrackType=proctrack/linuxproc",
                "TaskPlugin=task/none",
                "JobAcctGatherType=jobacct_gather/none",
                "AccountingStorageType=accounting_storage/none",
                "JobCompType=jobcomp/none",
                "SelectType=select/cons_tres",
                "SelectTypeParameters=CR_CPU",
                "SlurmdParameters=config_overrides",
                "ReturnToService=2",
                f"FirstJobId={random.randint(1000, 900_000)}",  # job ids pick ports (slurm/*.sh): vary them per cluster
                "KillWait=5",  # seconds between SIGTERM and SIGKILL when a step is killed: keeps failing tests short
                "InactiveLimit=0",
                "MinJobAge=300",  # keep finished jobs visible to scontrol show job
                f"StateSaveLocation={root}/state",
                f"SlurmdSpoolDir={root}/spool-%n",
                f"SlurmctldPidFile={root}/slurmctld.pid",
                f"SlurmdPidFile={root}/slurmd-%n.pid",
                f"SlurmctldLogFile={root}/slurmctld.log",
                f"SlurmdLogFile={root}/slurmd-%n.log",
                *node_lines,
                *partition_lines,
                "",
            ]
        )
    )
    return conf, nodes


def start_slurm_cluster(
    root: Path, node_count: int = 1, ready_timeout: float = 30, preemption: bool = False
) -> SlurmCluster:
    root.mkdir(parents=True, exist_ok=True)
    (root / "state").mkdir(exist_ok=True)
    conf, nodes = write_slurm_conf(root, node_count, preemption)
    cluster = SlurmCluster(root, conf, nodes)
    env = cluster.env
    # -i: ignore state left by an earlier run of this directory; the daemons fork into the background.
    subprocess.run(["slurmctld", "-i"], env=env, check=True, timeout=30)
    cluster.pid_files.append(root / "slurmctld.pid")
    for name in nodes:
        (root / f"spool-{name}").mkdir(exist_ok=True)
        subprocess.run(["slurmd", "-N", name], env=env, check=True, timeout=30)
        cluster.pid_files.append(root / f"slurmd-{name}.pid")
    deadline = time.monotonic() + ready_timeout
    while True:
        states = cluster.run("sinfo", "-h", "-N", "-o", "%N %T").stdout.split("\n")  # a line per node and partition
        if {line.split()[0] for line in states if line.strip() and line.split()[-1] in ("idle", "mixed")} == set(nodes):
            return cluster
        if time.monotonic() > deadline:
            stop_slurm_cluster(cluster)
            raise RuntimeError(f"slurm nodes not idle after {ready_timeout:.0f} s: {states}\n{cluster.logs()}")
        time.sleep(0.2)


def stop_slurm_cluster(cluster: SlurmCluster, grace_s: float = 10) -> None:
    """Stop every daemon this cluster started, by pid file: never by name, other Slurms may run on this host."""
    cluster.run("scancel", "--full", "--quiet", "-u", "root")  # jobs first, so no step outlives its slurmd
    pids = []
    for pid_file in cluster.pid_files:
        try:
            pids.append(int(pid_file.read_text().strip()))
        except (OSError, ValueError):
            continue  # never started, or already gone
    for pid in pids:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in pids:
        _signal(pid, signal.SIGKILL)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _alive(pid: int) -> bool:
    """True while the process runs; a zombie (exited, not yet reaped by whoever adopted it) counts as gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def slurm_cluster_fixture(tmp_path_factory: pytest.TempPathFactory, node_count: int, preemption: bool = False):
    """Body of a pytest fixture: skip without Slurm, else yield a running cluster and always stop it."""
    missing = missing_slurm_binaries()
    if missing:
        pytest.skip(f"Slurm is not installed ({', '.join(missing)} not found); run .ci/install-system.sh as root")
    if os.geteuid() != 0:
        pytest.skip("the throw-away Slurm cluster runs its daemons as root (SlurmUser=root); run the tests as root")
    cluster = start_slurm_cluster(tmp_path_factory.mktemp(f"slurm{node_count}"), node_count, preemption=preemption)
    try:
        yield cluster
    finally:
        stop_slurm_cluster(cluster)
