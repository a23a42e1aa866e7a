"""Launch detection from environment variables: precedence, each source, partial environments, Slurm lists;
and launch/torchrun.sh end to end with a crashing rank (mpirun and srun: tests/launchers/test_mpirun.py and
tests/launchers/test_slurm.py).
"""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from spmd_rl.runtime.errors import UserError
from spmd_rl.runtime.launch import (
    LAUNCH_SOURCES,
    detect_launch,
    expand_nodelist,
    expand_tasks_per_node,
    from_mpi,
    from_slurm,
    from_torchrun,
    mpi_rank_from_env,
    slurm_default_port,
)

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = {
    "TORCHELASTIC_RUN_ID": "none",
    "RANK": "3",
    "WORLD_SIZE": "4",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "MASTER_ADDR": "node01",
    "MASTER_PORT": "29500",
}
# What srun puts into task 5 of `srun -N 2 -n 8` (two nodes, four tasks each).
SRUN_TASK = {
    "SLURM_PROCID": "5",
    "SLURM_NTASKS": "8",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURM_STEP_ID": "0",
    "SLURM_JOB_ID": "4242",
    "SLURM_JOB_NODELIST": "node[07-08]",
    "SLURM_STEP_NODELIST": "node[07-08]",
    "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
}


def test_no_launcher_is_a_single_process():
    info = detect_launch({})
    assert (info.launcher, info.rank, info.world_size, info.init_method) == ("none", 0, 1, "")
    assert not info.distributed


def test_torchrun():
    info = detect_launch(TORCHRUN)
    assert (info.launcher, info.rank, info.world_size, info.local_rank, info.local_world_size) == (
        "torchrun",
        3,
        4,
        1,
        2,
    )
    assert info.init_method == "env://"
    by_hand = {key: value for key, value in TORCHRUN.items() if not key.startswith("TORCHELASTIC")}
    assert detect_launch(by_hand).launcher == "env"  # the start line does not claim torchrun for ranks started by hand


def test_torchrun_wins_over_slurm_under_srun_torchrun():
    # Workers of `srun torchrun` inherit the agent's SLURM_PROCID (the node index), which is not their rank.
    info = detect_launch({**SRUN_TASK, **TORCHRUN})
    assert (info.launcher, info.rank) == ("torchrun", 3)


def test_torchrun_partial_environment_names_the_missing_variables():
    with pytest.raises(UserError, match="MASTER_ADDR, MASTER_PORT are missing"):
        detect_launch({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"})


def test_slurm_srun_task():
    info = detect_launch(SRUN_TASK)
    assert (info.launcher, info.rank, info.world_size, info.local_rank, info.local_world_size) == ("slurm", 5, 8, 1, 4)
    assert info.init_method == f"tcp://node07:{slurm_default_port(4242)}"


def test_slurm_master_address_and_port_can_be_overridden():
    info = detect_launch({**SRUN_TASK, "MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "31000"})
    assert info.init_method == "tcp://10.0.0.7:31000"


def test_slurm_single_node_needs_no_tasks_per_node():
    env = {
        "SLURM_PROCID": "1",
        "SLURM_NTASKS": "2",
        "SLURM_LOCALID": "1",
        "SLURM_STEP_ID": "0",
        "SLURM_JOB_ID": "7",
        "SLURM_NODELIST": "vm",
    }
    info = detect_launch(env)
    assert (info.rank, info.world_size, info.local_world_size, info.init_method) == (1, 2, 2, "tcp://vm:20007")


def test_slurm_uneven_tasks_per_node_picks_this_node():
    env = {**SRUN_TASK, "SLURM_STEP_TASKS_PER_NODE": "5,3", "SLURM_PROCID": "6", "SLURM_LOCALID": "1"}
    assert detect_launch(env).local_world_size == 3


def test_slurm_batch_script_without_srun_is_a_single_process():
    # The batch step has SLURM_PROCID=0 and the job's task count but no step id: nobody else will join.
    batch = {key: value for key, value in SRUN_TASK.items() if not key.startswith("SLURM_STEP")}
    assert detect_launch({**batch, "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}).launcher == "none"


@pytest.mark.parametrize("missing", ["SLURM_NTASKS", "SLURM_LOCALID"])
def test_slurm_partial_environment_names_the_missing_variable(missing):
    env = {key: value for key, value in SRUN_TASK.items() if key != missing}
    with pytest.raises(UserError, match=f"{missing} is missing"):
        detect_launch(env)


def test_slurm_without_node_list_or_port_source_is_an_error():
    no_nodes = {key: value for key, value in SRUN_TASK.items() if "NODELIST" not in key}
    with pytest.raises(UserError, match="SLURM_JOB_NODELIST"):
        detect_launch(no_nodes)
    no_job = {key: value for key, value in SRUN_TASK.items() if key != "SLURM_JOB_ID"}
    with pytest.raises(UserError, match="MASTER_PORT"):
        detect_launch(no_job)


def test_slurm_contradictory_rank_is_an_error():
    with pytest.raises(UserError, match="contradictory"):
        detect_launch({**SRUN_TASK, "SLURM_PROCID": "8"})
    with pytest.raises(UserError, match="SLURM_LOCALID=4"):
        detect_launch({**SRUN_TASK, "SLURM_LOCALID": "4"})
    with pytest.raises(UserError, match="not an integer"):
        detect_launch({**SRUN_TASK, "SLURM_NTASKS": "eight"})


@pytest.mark.parametrize(
    "env, expected",
    [
        ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4"}, ("OMPI_COMM_WORLD_RANK", 2, 4)),
        ({"PMIX_RANK": "1"}, ("PMIX_RANK", 1, None)),
        ({"PMI_RANK": "0", "PMI_SIZE": "3"}, ("PMI_RANK", 0, 3)),
        ({**SRUN_TASK}, None),
        ({}, None),
    ],
)
def test_mpi_launch_is_read_from_the_launcher_variables(env, expected):
    assert mpi_rank_from_env(env) == expected


def test_mpi_contradictory_rank_is_an_error():
    with pytest.raises(UserError, match="contradictory"):
        mpi_rank_from_env({"OMPI_COMM_WORLD_RANK": "4", "OMPI_COMM_WORLD_SIZE": "4"})


def test_precedence_torchrun_then_mpi_then_slurm():
    # mpirun's ranks inside an allocation inherit the batch step's SLURM_* variables, and `srun torchrun` workers
    # the agent's: the sources that know the real rank are asked first. (from_mpi initializes MPI, so the order
    # is checked here and the real thing by tests/launchers/test_mpirun.py.)
    assert LAUNCH_SOURCES == [from_torchrun, from_mpi, from_slurm]


@pytest.mark.parametrize(
    "nodelist, hosts",
    [
        ("vm", ["vm"]),
        ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
        ("gpu[9-11],cpu5", ["gpu9", "gpu10", "gpu11", "cpu5"]),
        ("a[1,3],b[08-09]", ["a1", "a3", "b08", "b09"]),
        ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
        ("node-a.cluster,node-b.cluster", ["node-a.cluster", "node-b.cluster"]),
    ],
)
def test_expand_nodelist(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("nodelist", ["node[01-03", "node]1[", "node[a-b]", "", "x,,y"])
def test_expand_nodelist_rejects_malformed_lists(nodelist):
    with pytest.raises(UserError, match="node list"):
        expand_nodelist(nodelist)


def test_expand_tasks_per_node():
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert expand_tasks_per_node("4") == [4]
    with pytest.raises(UserError, match="tasks-per-node"):
        expand_tasks_per_node("2(3)")


@pytest.mark.parametrize("restarts", [0, pytest.param(1, marks=pytest.mark.slow)], ids=["once", "restarted"])
def test_torchrun_job_with_a_crashing_rank_fails(tmp_path, restarts):
    # With MAX_RESTARTS the rank crashes in every attempt; each attempt keeps its own failure records, and the job
    # summary (rank 0's or, when the agent killed rank 0 first, the script's from the last attempt) names it.
    repo = Path(__file__).resolve().parents[2]
    env = {
        **os.environ,
        "NPROC": "2",
        "MAX_RESTARTS": str(restarts),
        "PYTHON": sys.executable,
        "PYTHONPATH": str(repo),
        "GLOO_SOCKET_IFNAME": "lo",
    }
    command = [
        "launch/torchrun.sh",
        "--config",
        "configs/ci_tiny.yaml",
        f"run.dir={tmp_path / 'run'}",
        "env.id=tests.harness.crashing_env:Crashing-v0",
        "dist.timeout_s=20",
    ]
    job = subprocess.Popen(
        command, cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = job.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)  # the agent and every rank: nothing outlives the test
        output, _ = job.communicate()
        pytest.fail(f"torchrun job with a crashing rank still running after 180 s (a hang):\n{output[-4000:]}")
    # the crashing rank's code (an error in user code), not torchrun's 1 for any failure
    assert job.returncode == 4, output[-4000:]
    assert output.count("deliberate failure on rank 1") == restarts + 1, output[-4000:]
    summaries = [line for line in output.splitlines() if "job summary" in line]
    assert summaries and summaries[-1].startswith("spmd_rl: job summary: rank 1 (colocated 1) failed first"), output
    assert "stopping after this iteration" not in output, output[-4000:]
    # python -m spmd_rl.runs reads run.lock: the job's code (rank 1's), not rank 0's knock-on communication error
    assert json.loads((tmp_path / "run" / "run.lock").read_text())["exit_code"] == 4


# The agent's traceback when the whole process group is signalled: the signal reaches it directly and relayed by
# launch/torchrun.sh, and the second arrives while it logs the first (seen in CI: a chained traceback with a blank
# line inside a frame). A chain that holds any other exception is printed whole.
AGENT_CHAIN = """\
spmd_rl: stopped by SIGTERM after iteration 10; checkpoint runs/x/checkpoints/iter_000000010
Traceback (most recent call last):
  File "torch/distributed/elastic/agent/server/api.py", line 753, in run
    logger.warning("Received %s death signal, shutting down workers", e.sigval)
torch.distributed.elastic.multiprocessing.api.SignalException: Process 2144 got signal: 15

During handling of the above exception, another exception occurred:

Traceback (most recent call last):
  File "logging/__init__.py", line 292, in __init__
    def __init__(self, name, level, pathname, lineno,

  File "torch/distributed/elastic/multiprocessing/api.py", line 86, in _terminate_process_handler
    raise SignalException(f"Process {os.getpid()} got signal: {sigval}", sigval=sigval)
torch.distributed.elastic.multiprocessing.api.SignalException: Process 2144 got signal: 15
"""
REAL_CHAIN = """\
Traceback (most recent call last):
  File "a.py", line 1, in f
ValueError: the real error

During handling of the above exception, another exception occurred:

Traceback (most recent call last):
  File "api.py", line 86, in _terminate_process_handler
torch.distributed.elastic.multiprocessing.api.SignalException: Process 7 got signal: 15
"""


def _through_torchrun_filter(text):
    script, common = ROOT / "launch" / "torchrun.sh", ROOT / "launch" / "common.sh"  # the awk and spoke() it uses
    function = f"source {common}; source <(sed -n '/^drop_signal_traceback()/,/^}}/p' {script}); drop_signal_traceback"
    done = subprocess.run(["bash", "-c", function], input=text, capture_output=True, text=True, timeout=30)
    return done.stdout + done.stderr


def test_the_torchrun_filter_drops_the_agents_chained_signal_tracebacks_and_nothing_else():
    assert _through_torchrun_filter(AGENT_CHAIN + "after\n") == AGENT_CHAIN.splitlines()[0] + "\nafter\n"
    assert _through_torchrun_filter(REAL_CHAIN + "after\n") == REAL_CHAIN + "after\n"
    assert _through_torchrun_filter(REAL_CHAIN) == REAL_CHAIN  # the stream ends right after the chain
