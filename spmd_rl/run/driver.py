"""One rank's whole run after its config is read: check everything a user can get wrong before any process
group exists (the classes the config names, the layout, the env, the policy's outputs, the planned memory), then
start the runtime, agree on where the run starts, build the Run and hand it to the engine; every way out ends in
an exit code and, on failure, one line (spmd_rl.runtime.exits), with the postmortem naming the first cause."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import torch

from spmd_rl.config.sections import Config
from spmd_rl.envs.vector import EnvSpec, probe_env
from spmd_rl.persist.fileio import flush_open_files
from spmd_rl.persist.run_control import STOPPED_EXIT_CODE, RunControl, StoppedWithCheckpoint
from spmd_rl.run import contract
from spmd_rl.run.plan import Plan, dry_run_plan, plan_run
from spmd_rl.run.policies import save_policy
from spmd_rl.run.resume import agree_on_run, mark_finished
from spmd_rl.run.setup import Run
from spmd_rl.run.topology import Topology, build_topology, create_process_groups
from spmd_rl.runtime.distributed import (
    Runtime,
    choose_device,
    install_signal_handlers,
    shutdown_runtime,
    start_runtime,
    stop_at_iteration_boundary,
)
from spmd_rl.runtime.errors import (
    COMM_ERROR_EXIT_CODE,
    USER_CODE_EXIT_CODE,
    CommError,
    SharedUserError,
    StopSignal,
    UserCodeError,
    UserError,
)
from spmd_rl.runtime.exits import say, unexpected_error, user_error
from spmd_rl.runtime.launch import LaunchInfo
from spmd_rl.runtime.postmortem import Failure, after_failure


@dataclass
class Checked:
    """What the checks before start resolved: the same on every rank."""

    topology: Topology
    plan: Plan
    policy_cls: type
    algorithm_cls: type
    engine_cls: type
    callback_classes: list
    spec: EnvSpec
    outputs: dict
    gpu_slot: tuple[int | None, int]  # this rank's GPU on its node (None: an env rank), and how many it needs


def train(cfg: Config, launch: LaunchInfo, dry_run: bool = False) -> int:
    """This rank's run; returns its exit code."""
    checked = check_before_start(cfg, launch, dry_run)
    if isinstance(checked, int):
        return checked
    torch.set_num_threads(cfg.train.torch_threads)
    install_signal_handlers()
    runtime = None
    exit_code = 0
    who = checked.topology.describe(launch.rank)  # 'rank 2 (env 0)': how every failure line starts
    waited: CommError | None = None  # whom this rank was waiting on when it failed, and whether it timed out
    try:
        runtime = start_runtime(launch, cfg.train.device, cfg.dist.timeout_s, *checked.gpu_slot)
        run_engine(cfg, launch, runtime, checked, dry_run)
    except StoppedWithCheckpoint as exc:
        if launch.rank == 0:
            print(f"spmd_rl: {exc}", file=sys.stderr, flush=True)
        exit_code = STOPPED_EXIT_CODE
    except UserError as exc:  # found while running (a rank's files, a config that differs): say which rank
        exit_code = user_error(exc, speaker=launch.rank == 0 or not isinstance(exc, SharedUserError), rank=launch.rank)
    except CommError as exc:
        say(who, "communication error", exc)
        exit_code, waited = COMM_ERROR_EXIT_CODE, exc
    except UserCodeError as exc:
        say(who, "error in user code", exc)
        exit_code = USER_CODE_EXIT_CODE
    except KeyboardInterrupt:
        print(f"spmd_rl: {who}: interrupted (SIGINT)", file=sys.stderr, flush=True)
        exit_code = 130
    except StopSignal as exc:
        print(f"spmd_rl: {who}: stopped by {exc.signal_name}", file=sys.stderr, flush=True)
        exit_code = 128 + exc.signal_number
    except Exception as exc:
        exit_code = unexpected_error(exc, who)
    finally:
        failed_at = time.time()
        flush_open_files()  # staged experience rows reach their files on every exit path
        if exit_code not in (0, STOPPED_EXIT_CODE) and runtime is not None and runtime.distributed:
            # rank 0 names the first cause
            after_failure(
                Failure(
                    launch.rank, exit_code, failed_at, waited.peers if waited else (), bool(waited and waited.timed_out)
                ),
                launch.world_size,
                checked.topology.describe,
            )
        shutdown_runtime(runtime, exit_code)
    return exit_code


def check_before_start(cfg: Config, launch: LaunchInfo, dry_run: bool) -> Checked | int:
    """Everything a user can get wrong, before any process group exists; an exit code (2) after one line when
    something is wrong. The config and the layout are the same on every rank, so rank 0 speaks for all; the env
    (its packages, its files) belongs to a host, so the first rank of every host speaks for it."""
    try:
        topology = build_topology(cfg.layout, launch.world_size)
        policy_cls, algorithm_cls, engine_cls, callback_classes = contract.load_classes(cfg)
        plan = plan_run(cfg, topology, algorithm_cls)
        if dry_run:
            plan = dry_run_plan(plan)
    except UserError as exc:
        return user_error(exc, speaker=launch.rank == 0)
    try:
        spec = probe_env(cfg.env)
        outputs = contract.check_policy(cfg, spec, policy_cls, algorithm_cls)
        contract.check_planned_memory(cfg, spec, outputs, plan)
    except UserError as exc:
        return user_error(exc, speaker=launch.local_rank == 0, rank=launch.rank if launch.world_size > 1 else None)
    gpu_slot = topology.gpu_slot(launch.rank, launch.local_rank, launch.local_world_size)
    try:
        choose_device(cfg.train.device, *gpu_slot)  # enough GPUs on this node: said before any group exists
    except UserError as exc:
        return user_error(exc, speaker=launch.local_rank == 0, rank=launch.rank if launch.world_size > 1 else None)
    return Checked(topology, plan, policy_cls, algorithm_cls, engine_cls, callback_classes, spec, outputs, gpu_slot)


def run_engine(cfg: Config, launch: LaunchInfo, runtime: Runtime, checked: Checked, dry_run: bool) -> None:
    """Agree on the run directory and the start, build the Run, hand it to the engine, save the policy."""
    topology, plan = checked.topology, checked.plan
    run_dir, resume = agree_on_run(cfg, runtime, dry_run=dry_run)
    if runtime.rank == 0:
        start = f"; resuming from {resume.checkpoint} (iteration {resume.start_iteration})" if resume.checkpoint else ""
        print(
            f"spmd_rl: launcher {launch.launcher}, backend {runtime.backend}, device {runtime.device}; "
            f"{plan.describe(cfg, launch.world_size, _layout_name(topology), checked.algorithm_cls)}; "
            f"run directory {run_dir}{start}",
            flush=True,
        )
    groups = create_process_groups(topology, runtime.timeout)
    control = RunControl(
        cfg, plan.num_iterations, runtime.rank, runtime.world_size, runtime.distributed, run_dir, runtime.timeout
    )
    run = Run(
        cfg=cfg,
        plan=plan,
        runtime=runtime,
        topology=topology,
        groups=groups,
        spec=checked.spec,
        outputs=checked.outputs,
        run_dir=run_dir,
        policy_cls=checked.policy_cls,
        algorithm_cls=checked.algorithm_cls,
        callback_classes=checked.callback_classes,
        control=control,
        resume=resume,
    )
    stop_at_iteration_boundary(True)  # from here a signal stops the run at an iteration boundary, checkpointed
    try:
        checked.engine_cls(cfg.engine).run(run)
    except StoppedWithCheckpoint:
        if runtime.rank == 0:
            save_policy(run.final_policy, run_dir)
        control.wait_for_stop_files()
        raise
    finally:
        stop_at_iteration_boundary(False)
    if runtime.rank == 0:
        save_policy(run.final_policy, run_dir)
        mark_finished(run_dir)
        if dry_run:
            print(
                f"spmd_rl: dry run passed: one iteration in the real layout, every role and channel, one weight sync "
                f"({run_dir})",
                flush=True,
            )


def _layout_name(topology) -> str:
    if topology.colocated:
        return "colocated"
    return (
        f"split (trainer {len(topology.trainer_ranks)}, inference {len(topology.inference_ranks)}, "
        f"env {len(topology.env_ranks)})"
    )
