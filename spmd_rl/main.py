"""The program every rank runs: `python -m spmd_rl.main [--config FILE] [--dry-run] [section.key=value ...]`.

Everything a user can get wrong is checked before any process group exists (config, the classes it names, layout,
env id, spaces, the policy's declared outputs against what it returns), so bad input ends every rank with exit
code 2 and one line, never a hang or a traceback. torch is imported only after the config is read, so `--help` and
config errors answer at once.

Exit codes: 0 done, 2 user error (config, files, plug-in contract), 3 communication error, 4 an error in the
user's code (env, policy, algorithm, callback) or bad data from it, 128 + N stopped by signal N.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

from spmd_rl.config.schema import Config, describe_schema, load_config
from spmd_rl.runtime.errors import (COMM_ERROR_EXIT_CODE, USER_CODE_EXIT_CODE, USER_ERROR_EXIT_CODE, CommError, SharedUserError,
                            StopSignal, UserCodeError, UserError, describe_exception, user_frame)
from spmd_rl.runtime.launch import detect_launch, rank_from_env

USAGE_EXAMPLES = """\
examples:
  python -m spmd_rl.main                                    # PPO on CartPole-v1 in one process
  python -m spmd_rl.main --config configs/ppo_pendulum.yaml train.total_steps=200000
  torchrun --standalone --nproc_per_node=8 -m spmd_rl.main --config configs/ppo_cartpole_split.yaml
  python -m spmd_rl.main --config my.yaml policy.class=my_pkg.nets:MyPolicy --dry-run

config sections and keys (override any with section.key=value); the algo, policy, engine and callbacks sections
list the keys of the classes this config selects:
"""

# Set to 1 to print full tracebacks instead of the one-line summaries of errors in user code.
DEBUG_VARIABLE = "SPMD_RL_DEBUG"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m spmd_rl.main", add_help=False,
        description="Train a policy with spmd_rl. Every rank runs this same program (torchrun, mpirun, srun, or "
                    "one process).",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-h", "--help", action="store_true", help="show this help (with the keys of the classes "
                        "the given config selects) and exit")
    parser.add_argument("--config", metavar="FILE", help="YAML config (default: the embedded PPO CartPole-v1 "
                        "config, the same as configs/ppo_cartpole.yaml)")
    parser.add_argument("--dry-run", action="store_true", help="run one real iteration in the real layout (every "
                        "role, every channel, one weight sync) in a temporary run directory, then exit 0")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides")
    args = parser.parse_args(argv)
    args.format_help = parser.format_help
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Everything a user can get wrong, checked before any process group exists. The config and the layout are
    # the same on every rank, so rank 0 speaks for all; the env (its packages, its files) belongs to a host, so
    # the first rank of every host speaks for it.
    try:
        cfg = load_config(args.config, args.overrides)
    except UserError as exc:  # before the launch is known: the launcher's rank variable says who is rank 0
        return _user_error(exc, speaker=rank_from_env() in (None, 0))
    if args.help:
        print(args.format_help() + "\n" + USAGE_EXAMPLES + describe_schema(cfg))
        return 0
    try:
        launch = detect_launch()
    except UserError as exc:
        return _user_error(exc, speaker=True)

    from spmd_rl.envs.vector import probe_env
    from spmd_rl.run import contract
    from spmd_rl.run.plan import dry_run_plan, plan_run
    from spmd_rl.runtime.topology import build_topology
    try:
        topology = build_topology(cfg.layout, launch.world_size)
        policy_cls, algorithm_cls, engine_cls, callback_classes = contract.load_classes(cfg)
        plan = plan_run(cfg, topology, algorithm_cls)
        if args.dry_run:
            plan = dry_run_plan(plan)
    except UserError as exc:
        return _user_error(exc, speaker=launch.rank == 0)
    try:
        spec = probe_env(cfg.env)
        outputs = contract.check_policy(cfg, spec, policy_cls, algorithm_cls)
        contract.check_planned_memory(cfg, spec, outputs, plan)
    except UserError as exc:
        return _user_error(exc, speaker=launch.local_rank == 0, rank=launch.rank if launch.world_size > 1 else None)

    import torch

    from spmd_rl.persist.fileio import flush_open_files
    from spmd_rl.persist.run_control import STOPPED_EXIT_CODE, RunControl, StoppedWithCheckpoint
    from spmd_rl.runtime.distributed import install_signal_handlers, shutdown_runtime, start_runtime, stop_at_iteration_boundary
    from spmd_rl.run.policies import save_policy
    from spmd_rl.run.setup import Run, mark_finished
    from spmd_rl.runtime.topology import create_process_groups
    torch.set_num_threads(cfg.train.torch_threads)
    install_signal_handlers()
    runtime = None
    exit_code = 0
    who = topology.describe(launch.rank)  # 'rank 2 (env 0)': how every failure line starts
    waited: CommError | None = None      # whom this rank was waiting on when it failed, and whether it timed out
    try:
        runtime = start_runtime(launch, cfg.train.device, cfg.dist.timeout_s)
        run_dir, resume = _agree_on_run(cfg, runtime, dry_run=args.dry_run)
        if runtime.rank == 0:
            start = (f"; resuming from {resume.checkpoint} (iteration {resume.start_iteration})"
                     if resume.checkpoint else "")
            print(f"spmd_rl: launcher {launch.launcher}, backend {runtime.backend}, device {runtime.device}; "
                  f"{plan.describe(cfg, launch.world_size, _layout_name(topology), algorithm_cls)}; "
                  f"run directory {run_dir}{start}", flush=True)
        groups = create_process_groups(topology, runtime.timeout)
        control = RunControl(cfg, plan.num_iterations, runtime.rank, runtime.world_size, runtime.distributed,
                             run_dir, runtime.timeout)
        run = Run(cfg=cfg, plan=plan, runtime=runtime, topology=topology, groups=groups, spec=spec,
                             outputs=outputs, run_dir=run_dir, policy_cls=policy_cls, algorithm_cls=algorithm_cls,
                             callback_classes=callback_classes, control=control, resume=resume)
        stop_at_iteration_boundary(True)  # from here a signal stops the run at an iteration boundary, checkpointed
        try:
            engine_cls(cfg.engine).run(run)
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
            if args.dry_run:
                print(f"spmd_rl: dry run passed: one iteration in the real layout, every role and channel, one "
                      f"weight sync ({run_dir})", flush=True)
    except StoppedWithCheckpoint as exc:
        if launch.rank == 0:
            print(f"spmd_rl: {exc}", file=sys.stderr, flush=True)
        exit_code = STOPPED_EXIT_CODE
    except UserError as exc:  # found while running (a rank's files, a config that differs): say which rank
        exit_code = _user_error(exc, speaker=launch.rank == 0 or not isinstance(exc, SharedUserError),
                                rank=launch.rank)
    except CommError as exc:
        _say(who, "communication error", exc)
        exit_code, waited = COMM_ERROR_EXIT_CODE, exc
    except UserCodeError as exc:
        _say(who, "error in user code", exc)
        exit_code = USER_CODE_EXIT_CODE
    except KeyboardInterrupt:
        print(f"spmd_rl: {who}: interrupted (SIGINT)", file=sys.stderr, flush=True)
        exit_code = 130
    except StopSignal as exc:
        print(f"spmd_rl: {who}: stopped by {exc.signal_name}", file=sys.stderr, flush=True)
        exit_code = 128 + exc.signal_number
    except Exception as exc:
        exit_code = _unexpected_error(exc, who)
    finally:
        failed_at = time.time()
        flush_open_files()  # staged experience rows reach their files on every exit path
        if exit_code not in (0, STOPPED_EXIT_CODE) and runtime is not None and runtime.distributed:
            from spmd_rl.runtime.postmortem import Failure, after_failure  # rank 0 names the first cause
            after_failure(Failure(launch.rank, exit_code, failed_at, waited.peers if waited else (),
                                  bool(waited and waited.timed_out)), launch.world_size, topology.describe)
        shutdown_runtime(runtime, exit_code)
    return exit_code


# How long a rank that leaves an error's line to the speaking rank waits before exiting. Launchers stop every rank
# as soon as one exits, so a quiet rank exiting first would stop a speaker that finds the same error a moment later
# (a busier rank) before its line is printed; the speaker's exit stops the quiet ranks instead.
QUIET_RANK_LINGER_S = 10.0


def _user_error(exc: UserError, speaker: bool, rank: int | None = None) -> int:
    if speaker:
        where = f"rank {rank}: " if rank is not None else ""
        print(f"spmd_rl: {where}error: {exc}", file=sys.stderr, flush=True)
    else:
        time.sleep(QUIET_RANK_LINGER_S)
    return USER_ERROR_EXIT_CODE


def _say(who: str, kind: str, exc: Exception) -> None:
    """One line: 'spmd_rl: rank 2 (env 0): communication error: ...' (the message's own 'rank 2 ...: ' dropped)."""
    message = str(exc)
    for prefix in (f"{who}: ", f"{who.split(' (')[0]}: "):
        message = message.removeprefix(prefix)
    print(f"spmd_rl: {who}: {kind}: {message}", file=sys.stderr, flush=True)
    if os.environ.get(DEBUG_VARIABLE, "") not in ("", "0"):
        traceback.print_exception(exc)


def _unexpected_error(exc: Exception, who: str) -> int:
    """An exception raised in the user's code (env, plug-in) is one line naming the user's file:line (exit 4);
    anything else is a bug of ours, shown with its traceback (exit 1). SPMD_RL_DEBUG=1 shows every traceback."""
    debug = os.environ.get(DEBUG_VARIABLE, "") not in ("", "0")
    if user_frame(exc) and not debug:
        print(f"spmd_rl: {who}: error in user code: {describe_exception(exc)} (set {DEBUG_VARIABLE}=1 for the "
              f"traceback)", file=sys.stderr, flush=True)
        return USER_CODE_EXIT_CODE
    print(f"spmd_rl: {who} failed:", file=sys.stderr)
    traceback.print_exc()
    return USER_CODE_EXIT_CODE if user_frame(exc) else 1


def _layout_name(topology) -> str:
    if topology.colocated:
        return "colocated"
    return (f"split (trainer {len(topology.trainer_ranks)}, inference {len(topology.inference_ranks)}, "
            f"env {len(topology.env_ranks)})")


def _agree_on_run(cfg: Config, runtime, dry_run: bool = False):
    """Rank 0 names the run directory and decides where the run starts (a checkpoint to resume from, or
    iteration 0; a run directory that would mix two runs is refused); every rank checks it runs rank 0's exact
    config; rank 0 saves it. Returns (run directory, Resume)."""
    import torch
    import torch.distributed as dist

    from spmd_rl.persist.run_control import Resume, checkpoint_iteration, decide_resume, prepare_run_dir
    from spmd_rl.runtime.distributed import broadcast_text
    resume, verdict = Resume(), ""
    if runtime.rank == 0:
        run_dir = _default_run_dir(cfg, dry_run)
        if not dry_run:
            try:
                resume = decide_resume(cfg, Path(run_dir), runtime.world_size)
                verdict = str(resume.checkpoint or "")
            except UserError as exc:
                verdict = f"error: {exc}"
    else:
        run_dir = ""
    if runtime.distributed:  # plain bytes: nothing is unpickled
        run_dir = broadcast_text(run_dir, src=0, timeout=runtime.timeout)
        verdict = broadcast_text(verdict, src=0, timeout=runtime.timeout)
    if verdict.startswith("error: "):
        raise SharedUserError(verdict[len("error: "):])
    if verdict:
        resume = Resume(checkpoint=Path(verdict), iteration=checkpoint_iteration(Path(verdict)))
    cfg.run.dir = run_dir
    if runtime.distributed:
        mine = torch.frombuffer(bytearray.fromhex(cfg.digest()), dtype=torch.uint8)
        digests = [torch.empty_like(mine) for _ in range(runtime.world_size)]
        dist.all_gather(digests, mine)
        differing = [r for r, d in enumerate(digests) if not torch.equal(d, digests[0])]
        if differing:
            raise UserError(f"rank(s) {differing} run a different config than rank 0 (config hash differs); "
                            f"give every rank the same --config file and the same overrides")
    path = Path(run_dir)
    if runtime.rank == 0:
        from spmd_rl.persist.fileio import make_dirs, write_atomic
        make_dirs(path)  # a read-only or misplaced run.dir is a UserError naming it
        prepare_run_dir(path, resume)
        write_atomic(path / "config.yaml", cfg.to_yaml())
    return path, resume


def _default_run_dir(cfg: Config, dry_run: bool) -> str:
    if dry_run:
        return tempfile.mkdtemp(prefix=f"spmd_rl-dry-run-{cfg.run.name}-")
    if cfg.run.dir:
        return cfg.run.dir
    if cfg.run.resume not in ("auto", "never"):  # a checkpoint path: continue in its run directory
        from spmd_rl.persist.checkpoint import find_checkpoint
        return str(find_checkpoint(cfg.run.resume).parent.parent)
    # Under torchrun the run id is the same after a restart (--max-restarts), so the restarted workers find the
    # checkpoints of the run they continue.
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id and os.environ.get("TORCHELASTIC_RESTART_COUNT") is not None:
        return f"runs/{cfg.run.name}-{run_id}"
    return f"runs/{cfg.run.name}-{datetime.datetime.now():%Y%m%d-%H%M%S}"


if __name__ == "__main__":
    sys.exit(main())
