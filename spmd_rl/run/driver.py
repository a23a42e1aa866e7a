"""One rank's whole run after its config is read: check everything a user can get wrong before any process
group exists (the classes the config names, the layout, the env, the policy's outputs, the planned memory; env
ranks leave the policy to the ranks that build it and learn its outputs, or their refusal, right after start), then
start the runtime, agree on where the run starts, build the Run and hand it to the engine; every way out ends in
an exit code and, on failure, one line (spmd_rl.runtime.exits), with the postmortem naming the first cause.

`train` is what `python -m spmd_rl.main` runs on every rank; `train_in_process` is the same run in one process for
the Python API (spmd_rl.train), where errors raise instead of becoming exit codes.

Over 400 lines: a rank's whole way from its config to its exit code (the checks before start, the agreement on
the policy right after it, the engine's hand-off and every failure path) reads as one story, in the order it runs."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from spmd_rl.config.loading import evaluation_env
from spmd_rl.config.sections import Config
from spmd_rl.envs.vector import EnvSpec, check_same_spaces, probe_env
from spmd_rl.interfaces.algorithm import Algorithm
from spmd_rl.interfaces.policy import Policy
from spmd_rl.modules.pretrained import reading_deferred
from spmd_rl.persist.fileio import flush_open_files
from spmd_rl.persist.run_control import RunControl, StoppedWithCheckpoint
from spmd_rl.persist.run_lock import record_exit, release_run_dirs
from spmd_rl.run import contract
from spmd_rl.run.evaluation import check_video, probe_eval_env
from spmd_rl.run.plan import Plan, dry_run_plan, plan_run
from spmd_rl.run.policies import PolicySpec, PrebuiltPolicy, save_policy, trainers_read_own_rows
from spmd_rl.run.resume import agree_on_run, mark_finished, settle_start
from spmd_rl.run.run import Run
from spmd_rl.run.topology import ENV, Topology, build_topology, create_process_groups
from spmd_rl.run.trackers import check_installed
from spmd_rl.runtime.distributed import (
    Runtime,
    agree_on_refusal,
    as_comm_error,
    broadcast_text,
    choose_device,
    shutdown_runtime,
    start_runtime,
)
from spmd_rl.runtime.errors import (
    COMM_ERROR_EXIT_CODE,
    STOPPED_EXIT_CODE,
    USER_CODE_EXIT_CODE,
    USER_ERROR_EXIT_CODE,
    CommError,
    SharedUserError,
    StopSignal,
    UserCodeError,
    UserError,
    describe_exception,
)
from spmd_rl.runtime.exits import leave_exit_code, line_start, process_exit_code, say, unexpected_error, user_error
from spmd_rl.runtime.job_store import open_job_store
from spmd_rl.runtime.launch import LaunchInfo
from spmd_rl.runtime.meeting import StartAbandoned, exit_before_start, refuse_start, tell_rank_0
from spmd_rl.runtime.postmortem import FROZEN_S, Failure, after_failure
from spmd_rl.runtime.signals import STOP_SIGNALS, install_signal_handlers, stop_at_iteration_boundary, stop_cause
from spmd_rl.runtime.user_exits import say_user_exit
from spmd_rl.runtime.watchdog import watchdog


@dataclass
class Checked:
    """What the checks before start resolved: the same on every rank."""

    cfg: Config  # the config the run executes: the given one with the plan's env counts per env rank (config.yaml)
    # The config as the command gave it (env.total_envs not yet spread): what a sweep, which never sees the world
    # size, knows its runs by; finished.json records its resume digest
    given: Config
    topology: Topology
    plan: Plan
    policy_cls: type[Policy] | None  # None on an env rank: it never imports the policy's module
    algorithm_cls: type[Algorithm[Any]]
    engine_cls: type
    callback_classes: list
    spec: EnvSpec
    # Its outputs, recurrent state, size: read on the meta device, built nowhere yet. None on an env rank, and
    # `policy_refusal` the check's UserError on a rank that builds it, in a layout with env ranks: those learn both
    # once the process group exists (agree_on_policy), so that every rank refuses together.
    policy_spec: PolicySpec | None
    gpu_slot: tuple[int | None, int]  # this rank's GPU on its node (None: an env rank), and how many it needs
    built_before: int  # Policy.real_constructions when the checks began: this run's builds are counted from here
    policy_refusal: str = ""
    prebuilt: PrebuiltPolicy | None = None  # trainer 0's policy, when its checks called act on it (split, env ranks)


@dataclass
class Outcome:
    """How a rank's run ended without an error: finished, or stopped with a checkpoint."""

    run_dir: Path
    policy: Policy | None  # rank 0's final policy (saved as policy.pt); None elsewhere
    stopped: StoppedWithCheckpoint | None = None  # the stop, when the ranks agreed on one


def train(cfg: Config, launch: LaunchInfo, dry_run: bool = False) -> int:
    """This rank's run; returns its exit code."""

    # User code may hang from the first import on. Before the process group forms, a hang in the checks before start
    # (the watchdog's line) and an os._exit there (its guard's line) end this rank without unwinding: on_expiry
    # leaves the exit code for rank 0, as exit_before_start does for sys.exit, else rank 0 waited out dist.timeout_s
    # and said this rank did not join (fault pass 5, P3h).
    def tell_rank_0_before_start() -> None:
        tell_rank_0(launch, USER_CODE_EXIT_CODE, "", spoke=True, timeout_s=cfg.dist.timeout_s)

    watchdog.configure(cfg.dist.timeout_s, f"rank {launch.rank}", on_expiry=tell_rank_0_before_start)
    # Open before rank 0's checks, so that another rank's failed check reaches it at once (runtime/meeting.py).
    job_store = open_job_store(launch, cfg.dist.timeout_s)
    checked = check_before_start(cfg, launch, dry_run)
    if isinstance(checked, int):
        return checked
    cfg = checked.cfg  # the config the run executes (the plan's env counts per env rank)
    configure_torch(cfg)
    install_signal_handlers()
    runtime = None
    outcome = None
    exit_code = 0
    who = checked.topology.describe(launch.rank)  # 'rank 2 (env 0)': how every failure line starts

    def after_a_hang() -> None:  # the watchdog's last act before it ends this rank: files whole, the record left
        flush_open_files()
        if runtime is not None and runtime.distributed:
            failure = Failure(launch.rank, USER_CODE_EXIT_CODE, time.time())
            after_failure(failure, launch.world_size, checked.topology.describe)

    watchdog.configure(cfg.dist.timeout_s, who, on_expiry=after_a_hang)
    waited: CommError | None = None  # whom this rank was waiting on when it failed, and whether it timed out
    try:
        runtime = start_runtime(launch, cfg.train.device, cfg.dist.timeout_s, *checked.gpu_slot, job_store)
        outcome = run_engine(cfg, launch, runtime, checked, dry_run)
        if outcome.stopped is not None:
            exit_code = STOPPED_EXIT_CODE  # before the line: run.lock records the stop even if the line fails
            if launch.rank == 0:
                print(f"spmd_rl: {outcome.stopped}", file=sys.stderr, flush=True)
    except BaseException as raised:
        # When user code raised again while the run unwound (an Algorithm's close after its learn failed), the
        # line names the first error, and a second line the later one.
        first = first_error(raised)
        if not isinstance(first, (Exception, KeyboardInterrupt, StopSignal, SystemExit)):
            raise
        frozen_s = watchdog.frozen_for(within_s=cfg.dist.timeout_s + 5)
        exit_code, waited, spoke = _report_failure(first, launch, who, started=runtime is not None, frozen_s=frozen_s)
        if first is not raised and spoke:
            print(
                f"{line_start(who)}then, while cleaning up: {describe_exception(raised)}", file=sys.stderr, flush=True
            )
    finally:
        failed_at = time.time()
        flush_open_files()  # staged experience rows reach their files on every exit path
        job_code = exit_code
        if exit_code not in (0, STOPPED_EXIT_CODE) and runtime is not None and runtime.distributed:
            # rank 0 names the first cause
            peers, timed_out = (waited.peers, waited.timed_out) if waited else ((), False)
            frozen_s = watchdog.frozen_for(within_s=cfg.dist.timeout_s + 5)
            job_code = after_failure(
                Failure(launch.rank, exit_code, failed_at, peers, timed_out, frozen_s),
                launch.world_size,
                checked.topology.describe,
            )
        if launch.rank == 0:
            leave_exit_code(exit_code)
        # run.lock (rank 0's), before the teardown a launcher may cut short with SIGKILL: the job's code, the first
        # cause the summary names (rank 1's error in user code), not rank 0's knock-on communication error
        record_exit(job_code)
        shutdown_runtime(runtime, process_exit_code(exit_code, outcome and outcome.stopped))  # run.lock: 75 above
        release_run_dirs()  # the exit is recorded above
    if dry_run and exit_code == 0 and launch.rank == 0:
        assert outcome is not None  # the run finished
        _end_dry_run(outcome.run_dir)
    return process_exit_code(exit_code, outcome and outcome.stopped)


def _report_failure(
    exc: BaseException, launch: LaunchInfo, who: str, started: bool, frozen_s: float = 0.0
) -> tuple[int, CommError | None, bool]:
    """One line for how this rank failed: (exit code, the wait it failed in or None, whether this rank spoke).
    frozen_s: how long this process did not run at all during its last dist.timeout_s (SIGSTOP)."""
    if isinstance(exc, (KeyboardInterrupt, StopSignal)):
        code, what = (
            (130, "interrupted (SIGINT)")
            if isinstance(exc, KeyboardInterrupt)
            else (128 + exc.signal_number, f"stopped by {exc.signal_name}{stop_cause()}")
        )
        if not started:  # as main.py's early handlers say it (fault pass 6, M3: rank 0 waiting for its peers)
            what += " while starting, before the run began"
        # A signal before the process group exists (started: False) is the job's stop, not a failure of this rank:
        # rank 0 speaks for the job, as main.py's early handlers do, and the launcher scripts when rank 0 could not.
        speaker = started or launch.rank == 0
        if speaker:
            print(f"{line_start(who)}{what}", file=sys.stderr, flush=True)
        return code, None, speaker
    if isinstance(exc, StartAbandoned):  # another rank's check failed: its line is out (its own, or rank 0's for it)
        return exc.exit_code, None, False
    if isinstance(exc, UserError):  # found while running (a rank's files, a config that differs): say which rank
        speaker = launch.rank == 0 or not isinstance(exc, SharedUserError)
        return user_error(exc, speaker=speaker, rank=launch.rank), None, speaker
    comm = as_comm_error(exc, who)  # a CommError, or torch's own collective failing (FSDP's all-gather in act)
    if comm is not None:
        if frozen_s >= FROZEN_S:
            # This rank was the one stopped: its deadline passed meanwhile, or its peers gave up on it and left; the
            # peer its line names did not fail it (fault pass 4, B2b: a rank woken after SIGSTOP blamed rank 0,
            # which had exited after waiting for it; E7, under mpirun: "rank 0 closed the connection").
            comm = CommError(
                f"{comm} (this rank itself did not run for {frozen_s:.0f} s of the wait: it was stopped (SIGSTOP or "
                f"Ctrl-Z, then continued), so the others likely waited on it)",
                comm.peers,
                comm.timed_out,
            )
        say(who, "communication error", comm)
        return COMM_ERROR_EXIT_CODE, comm, True
    if isinstance(exc, UserCodeError):
        say(who, "error in user code", exc)
        return USER_CODE_EXIT_CODE, None, True
    if isinstance(exc, SystemExit):  # the framework never exits by raising: this came from user code
        return say_user_exit(exc, who), None, True
    return unexpected_error(exc, who), None, True


def first_error(exc: BaseException) -> BaseException:
    """The error a failure began with. An exception raised while another unwound the stack (in a finally block or
    an except clause, without `raise ... from`) carries that one as its __context__: follow those links back to
    the first error. The framework translates errors only with `raise ... from`, which ends the walk."""
    while (
        exc.__cause__ is None
        and not exc.__suppress_context__
        and isinstance(exc.__context__, (Exception, KeyboardInterrupt, StopSignal, SystemExit))
        and not isinstance(exc.__context__, StoppedWithCheckpoint)
    ):
        exc = exc.__context__
    return exc


def _end_dry_run(run_dir: Path) -> None:
    """A dry run passed: its temporary run directory goes (after a failure it stays, to be looked at)."""
    shutil.rmtree(run_dir, ignore_errors=True)
    left = f"; its temporary run directory {run_dir} could not be removed" if run_dir.exists() else ""
    print(
        f"spmd_rl: dry run passed: one iteration in the real layout, every role and channel, one weight sync{left}",
        flush=True,
    )


def train_in_process(cfg: Config) -> Outcome:
    """The whole run in this process, for the Python API (spmd_rl.train): the same checks, run and files as
    `python -m spmd_rl.main` in one process, but a failure raises (UserError for bad input, UserCodeError or the
    user's own exception from user code) instead of becoming an exit code, and a stop (run.stop_after_iterations,
    a signal) returns with Outcome.stopped set. The process is left as it was found: torch's thread count, the
    signal handlers (installed only from the main thread) are restored; a stop asked of this run is forgotten when
    the next one starts (stop_at_iteration_boundary)."""
    launch = LaunchInfo("none", rank=0, world_size=1, local_rank=0, local_world_size=1, init_method="")
    checked = resolve(cfg, launch, dry_run=False)
    cfg = checked.cfg  # the config the run executes (the plan's env counts per env rank)
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    handlers = None
    if threading.current_thread() is threading.main_thread():
        handlers = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
        install_signal_handlers()
    configure_torch(cfg)
    runtime = None
    exit_code = 1  # what run.lock records: as `python -m spmd_rl.main` would have ended (an error raised here: 1)
    try:
        runtime = start_runtime(launch, cfg.train.device, cfg.dist.timeout_s, *checked.gpu_slot)
        outcome = run_engine(cfg, launch, runtime, checked, dry_run=False)
        exit_code = 0 if outcome.stopped is None else STOPPED_EXIT_CODE
        return outcome
    except UserError:
        exit_code = USER_ERROR_EXIT_CODE
        raise
    except UserCodeError:
        exit_code = USER_CODE_EXIT_CODE
        raise
    finally:
        flush_open_files()
        shutdown_runtime(runtime, 0)  # one process: no group to destroy
        release_run_dirs(exit_code)
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)
        if handlers is not None:
            for signum, handler in handlers.items():
                signal.signal(signum, handler)


class _Refused(Exception):
    """A check before start failed: the UserError, and who says it."""

    def __init__(self, error: UserError, speaker: bool, rank: int | None = None):
        super().__init__(str(error))
        self.error, self.speaker, self.rank = error, speaker, rank


def configure_torch(cfg: Config) -> None:
    """Intra-op threads (train.torch_threads) and, with train.deterministic, deterministic algorithms."""
    torch.set_num_threads(cfg.train.torch_threads)
    if cfg.train.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # what deterministic cuBLAS needs
        torch.use_deterministic_algorithms(True)


def check_before_start(cfg: Config, launch: LaunchInfo, dry_run: bool) -> Checked | int:
    """Everything a user can get wrong, before any process group exists; an exit code (2) after one line when
    something is wrong. The config and the layout are the same on every rank, so rank 0 speaks for all; the env
    (its packages, its files) belongs to a host, so the first rank of every host speaks for it."""
    try:
        return _check(cfg, launch, dry_run)
    except _Refused as refused:
        return refuse_start(launch, refused.error, refused.speaker, refused.rank, cfg.dist.timeout_s)
    except SystemExit as exc:  # sys.exit() in a policy's constructor or act, called by the contract check
        return exit_before_start(launch, exc, cfg.dist.timeout_s)


def resolve(cfg: Config, launch: LaunchInfo, dry_run: bool) -> Checked:
    """check_before_start's checks, raising the UserError instead of printing it."""
    try:
        return _check(cfg, launch, dry_run)
    except _Refused as refused:
        raise refused.error from None


def _check(given: Config, launch: LaunchInfo, dry_run: bool) -> Checked:
    built_before = Policy.real_constructions
    host_rank = launch.rank if launch.world_size > 1 else None
    policy_cls: type[Policy] | None = None
    try:
        topology = build_topology(given.layout, launch.world_size)
        # An env rank never builds the policy: it neither imports its module (a VLA's transformers and peft: a
        # quarter of an env rank's memory) nor checks it; the ranks that build it tell it the outcome after start.
        env_rank = not topology.colocated and topology.role_of(launch.rank) == ENV
        with watchdog.watch("importing the plug-in modules (policy, algo, engine, callbacks)"):
            if not env_rank:
                policy_cls = contract.load_classes(given)[0]
            algorithm_cls, engine_cls, callback_classes = contract.load_classes_but_policy(given)
        plan = plan_run(given, topology, algorithm_cls)
        if dry_run:
            plan = dry_run_plan(plan)
    except UserError as exc:
        raise _Refused(exc, speaker=launch.rank == 0) from None
    cfg = plan.run_config(given)  # from here on: the env counts per env rank, as every env rank makes its envs
    try:
        check_installed(cfg)  # log.wandb, log.mlflow: their packages (rank 0 uses them; every rank checks alike)
        with watchdog.watch(f"making env.id {cfg.env.id} (to read its spaces)"):
            # The interaction the plan decided travels with the spaces: whole episodes per rollout or windows.
            spec = replace(probe_env(cfg.env), episodes=plan.episodes)
        if cfg.eval.video_every:  # rank 0 records; every rank checks alike, so that all refuse together
            with watchdog.watch("rendering one frame of the evaluation env (eval.video_every)"):
                check_video(evaluation_env(cfg))
        if cfg.eval.env:  # held-out settings: the policy built for env's spaces must act there too
            with watchdog.watch("making eval.env's envs (to read their spaces)"):
                check_same_spaces(spec, probe_eval_env(cfg), "eval.env")
    except UserError as exc:
        raise _Refused(exc, speaker=launch.local_rank == 0, rank=host_rank) from None
    policy_spec, policy_refusal, prebuilt = None, "", None
    deferred = bool(topology.env_ranks) and not topology.colocated  # the refusal waits for env ranks to hear it
    if policy_cls is not None:
        try:  # rank 0 calls act and the algorithm's methods for every rank that builds the policy, once
            policy_spec = _check_policy(cfg, spec, plan, policy_cls, algorithm_cls, not deferred)
            if deferred and launch.rank == 0:  # on the instance it trains with (rank 0 is trainer 0)
                with watchdog.watch(f"building policy.class {cfg.classes['policy']} and calling its act"):
                    # sharded trainers read their own rows of a pretrained folder: trainer 0 reads none here
                    own_rows = trainers_read_own_rows(cfg, plan.parallel.sharded, algorithm_cls)
                    with reading_deferred() if own_rows else contextlib.nullcontext():
                        built = contract.build_checked(cfg, spec, policy_cls)
                    prebuilt = PrebuiltPolicy(built, torch.get_rng_state(), files_deferred=own_rows)
                    contract.check_calls(cfg, spec, algorithm_cls, built, policy_spec)
        except UserError as exc:
            if not deferred:  # every rank checks: each refuses in place
                raise _Refused(exc, speaker=launch.local_rank == 0, rank=host_rank) from None
            who = f"{topology.describe(launch.rank)}: " if launch.rank != 0 else ""
            policy_refusal = f"{who}{exc}"
    gpu_slot = topology.gpu_slot(launch.rank, launch.local_rank, launch.local_world_size)
    try:
        choose_device(cfg.train.device, *gpu_slot)  # enough GPUs on this node: said before any group exists
    except UserError as exc:
        raise _Refused(exc, speaker=launch.local_rank == 0, rank=host_rank) from None
    classes = (policy_cls, algorithm_cls, engine_cls, callback_classes)
    return Checked(
        cfg, given, topology, plan, *classes, spec, policy_spec, gpu_slot, built_before, policy_refusal, prebuilt
    )


def _check_policy(
    cfg: Config, spec: EnvSpec, plan: Plan, policy_cls: type[Policy], algorithm_cls, calls: bool
) -> PolicySpec:
    """The policy's contract and memory checks and the trainers' planned buffers, on a rank that builds it (with
    `calls`, act and the algorithm's methods called on sample observations: contract.check_policy)."""
    shards = plan.trainer_ranks if plan.parallel.sharded else 1  # FSDP divides the training state
    with watchdog.watch(f"building policy.class {cfg.classes['policy']} and calling its act"):
        policy_spec = contract.check_policy(cfg, spec, policy_cls, algorithm_cls, shards, calls)
    contract.check_planned_memory(cfg, spec, policy_spec.outputs, plan)
    return policy_spec


def agree_on_policy(checked: Checked, runtime: Runtime) -> PolicySpec:
    """The policy's spec on every rank, once the process group exists: a refusal of any rank that checked it is
    every rank's (exit 2, rank 0's one line), else rank 0's spec (a trainer's, the one whose act was called)
    reaches every rank, as text."""
    if not runtime.distributed or (checked.topology.colocated or not checked.topology.env_ranks):
        assert checked.policy_spec is not None  # every rank checked the policy before start
        return checked.policy_spec
    refusal = agree_on_refusal(checked.policy_refusal, runtime.timeout)
    if refusal:
        raise SharedUserError(refusal)
    text = checked.policy_spec.to_text() if checked.policy_spec is not None else ""
    return PolicySpec.from_text(broadcast_text(text, src=0, max_bytes=1 << 16, timeout=runtime.timeout))


def run_engine(cfg: Config, launch: LaunchInfo, runtime: Runtime, checked: Checked, dry_run: bool) -> Outcome:
    """Agree on the run directory and the start, build the Run, hand it to the engine, save the policy."""
    topology, plan = checked.topology, checked.plan
    policy_spec = agree_on_policy(checked, runtime)
    if dry_run:  # its temporary directory goes: no W&B or MLflow run for it
        cfg.log.wandb = cfg.log.mlflow = False
    run_dir, resume = agree_on_run(cfg, runtime, dry_run, checked.algorithm_cls.reshard_refusal)
    if runtime.rank == 0 and resume.fallback:
        print(f"spmd_rl: note: {resume.fallback}", flush=True)
    if runtime.rank == 0 and checked.spec.note:  # how the envs run, said once (MetaWorld's renderer)
        print(f"spmd_rl: note: {checked.spec.note}", flush=True)
    if runtime.rank == 0:
        start = ""
        if resume.checkpoint:  # iterations count from 0, as in metrics.jsonl, the checkpoints and the stop line
            start = (
                f"; resuming from {resume.checkpoint} after iteration {resume.iteration} (next: iteration "
                f"{resume.start_iteration} of 0..{plan.num_iterations - 1})"
            )
        print(
            f"spmd_rl: launcher {launch.launcher}, backend {runtime.backend}, device {runtime.device}; "
            f"{plan.describe(cfg, launch.world_size, _layout_name(topology), checked.algorithm_cls)}; "
            f"run directory {run_dir}{f' ({resume.note})' if resume.note else ''}{start}",
            flush=True,
        )
    stop_after = cfg.run.stop_after_iterations
    if runtime.rank == 0 and resume.checkpoint and 0 < stop_after <= resume.start_iteration:  # a count, from 0
        print(
            f"spmd_rl: note: run.stop_after_iterations={stop_after} is behind this resume (next: iteration "
            f"{resume.start_iteration}): it does not stop this run, which goes on to its end; set it to "
            f"{resume.start_iteration + 1} or more to stop it again",
            flush=True,
        )
    groups = create_process_groups(topology, runtime.group_timeout, plan.parallel)
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
        outputs=policy_spec.outputs,
        recurrent_state=policy_spec.recurrent_state,
        built_before=checked.built_before,
        prebuilt=checked.prebuilt,
        run_dir=run_dir,
        policy_cls=checked.policy_cls,
        algorithm_cls=checked.algorithm_cls,
        callback_classes=checked.callback_classes,
        control=control,
        resume=resume,
    )
    control.rank_facts = run.rank_facts
    control.after_commit = lambda: settle_start(run_dir, resume)  # called on rank 0 only
    stop_at_iteration_boundary(True)  # from here a signal stops the run at an iteration boundary, checkpointed
    try:
        checked.engine_cls(cfg.engine).run(run)
    except StoppedWithCheckpoint as stopped:
        if runtime.rank == 0:
            assert run.final_policy is not None  # rank 0 trains
            save_policy(run.final_policy, run_dir)
            if stopped.finished:  # run.stop_at_return: done, never resumed; said here, as it is no stop to rerun
                mark_finished(run_dir, checked.given.resume_digest(), run.rank_records())
                print(f"spmd_rl: {stopped}", flush=True)
        control.wait_for_stop_files()
        return Outcome(run_dir, run.final_policy, None if stopped.finished else stopped)
    finally:
        stop_at_iteration_boundary(False)
    if runtime.rank == 0:
        assert run.final_policy is not None  # rank 0 trains
        save_policy(run.final_policy, run_dir)
        mark_finished(run_dir, checked.given.resume_digest(), run.rank_records())
    return Outcome(run_dir, run.final_policy)


def _layout_name(topology) -> str:
    if topology.colocated:
        return "colocated"
    return (
        f"split (trainer {len(topology.trainer_ranks)}, inference {len(topology.inference_ranks)}, "
        f"env {len(topology.env_ranks)})"
    )
