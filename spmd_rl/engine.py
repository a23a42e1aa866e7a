"""The sync engine: one iteration is collect -> transfer -> learn -> broadcast weights -> next.

The plan (iterations, batch sizes, when weights move, when actions are random) is derived from the config and the
topology alone, so every rank knows its whole schedule before the first message. Each rank then runs the story of
its role: in the colocated layout all three roles take turns in one process through local channels; in the split
layout each rank runs one role's loop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from spmd_rl.api import Algorithm, Context, Engine, PlanFacts, Policy, StepField
from spmd_rl.comm.channel import local_channel, open_channels
from spmd_rl.comm.weights import WeightSync
from spmd_rl.config import Config
from spmd_rl.envs import EnvSpec, make_vector_env
from spmd_rl.errors import UserError
from spmd_rl.metrics import MetricsLogger
from spmd_rl.roles.env_worker import EnvWorker, run_env_rank
from spmd_rl.roles.inference_server import InferenceServer, UniformActions, run_inference_rank
from spmd_rl.roles.messages import action_message, observation_message, segment_message
from spmd_rl.roles.trainer import Trainer, run_trainer_rank
from spmd_rl.checkpoint import restore_rng_state
from spmd_rl.env_state import capture_env_state, restore_env_state, unsaved_env_reason
from spmd_rl.run_control import Resume, RunControl
from spmd_rl.runtime import Runtime
from spmd_rl.topology import ENV, INFERENCE, ProcessGroups, Topology


@dataclass(frozen=True)
class Plan:
    env_ranks: int
    trainer_ranks: int
    envs_total: int
    num_steps: int                    # env steps per env per iteration (the rollout length)
    steps_per_iteration: int          # env steps per iteration, all env ranks together
    num_iterations: int
    max_env_columns_per_trainer: int  # env columns of the busiest trainer
    sync_every: int                   # iterations between weight broadcasts
    explore_iterations: int           # first iterations acting uniformly at random (off-policy warm-up)

    def version_at(self, iteration: int) -> int:
        """The policy version every env step of this iteration must use (broadcasts so far)."""
        return iteration // self.sync_every

    def syncs_after(self, iteration: int) -> bool:
        return (iteration + 1) % self.sync_every == 0

    def explores_at(self, iteration: int) -> bool:
        return iteration < self.explore_iterations

    def facts(self) -> PlanFacts:
        return PlanFacts(trainer_ranks=self.trainer_ranks, env_ranks=self.env_ranks,
                         steps_per_iteration=self.steps_per_iteration,
                         samples_per_trainer=self.steps_per_iteration // self.trainer_ranks,
                         num_iterations=self.num_iterations)

    def describe(self, cfg: Config, world_size: int, layout: str, algorithm_cls: type[Algorithm]) -> str:
        text = (f"{cfg.classes['algo']} (policy {cfg.classes['policy']}) on {cfg.env.id}; world size {world_size}, "
                f"layout {layout}; {self.env_ranks} env rank(s) x {cfg.env.num_envs} envs = {self.envs_total} envs; "
                f"{self.steps_per_iteration} env steps per iteration ({self.num_steps} steps x {self.envs_total} "
                f"envs); {self.trainer_ranks} trainer rank(s); {self.num_iterations} iterations = "
                f"{self.num_iterations * self.steps_per_iteration} env steps")
        if self.explore_iterations:
            text += f"; {self.explore_iterations} iteration(s) of uniform random actions first"
        if self.sync_every > 1 and layout.startswith("split"):
            text += f"; weights broadcast every {self.sync_every} iterations"
        summary = algorithm_cls.summary(cfg.algo, self.facts())
        return text + (f"; {summary}" if summary else "")


def plan_run(cfg: Config, topology: Topology, algorithm_cls: type[Algorithm]) -> Plan:
    """Every rank's schedule, from the config and the topology alone; the algorithm checks its own constraints."""
    env_ranks = len(topology.env_ranks)
    envs_total = env_ranks * cfg.env.num_envs
    num_steps = cfg.algo.num_steps
    steps_per_iteration = envs_total * num_steps
    num_iterations = cfg.train.total_steps // steps_per_iteration
    if num_iterations < 1:
        raise UserError(f"train.total_steps={cfg.train.total_steps} is less than one iteration "
                        f"({steps_per_iteration} env steps = algo.num_steps x env.num_envs x {env_ranks} env ranks); "
                        f"raise train.total_steps to at least {steps_per_iteration}")
    env_ranks_per_trainer = [len(topology.envs_trained_by(t)) for t in topology.trainer_ranks]
    if len(set(env_ranks_per_trainer)) > 1:
        # DDP (and gradient averaging) weighs every trainer equally: unequal shares would overweight the samples
        # of the trainers with fewer env ranks.
        raise UserError(f"layout.env={len(topology.env_ranks)} env ranks cannot be shared equally by "
                        f"layout.trainer={len(topology.trainer_ranks)} trainers; make layout.env a multiple of "
                        f"layout.trainer")
    schedule = algorithm_cls.schedule(cfg.algo)
    plan = Plan(
        env_ranks=env_ranks,
        trainer_ranks=len(topology.trainer_ranks),
        envs_total=envs_total,
        num_steps=num_steps,
        steps_per_iteration=steps_per_iteration,
        num_iterations=num_iterations,
        max_env_columns_per_trainer=max(env_ranks_per_trainer) * cfg.env.num_envs,
        sync_every=schedule.weight_sync_every,
        explore_iterations=math.ceil(schedule.random_steps / steps_per_iteration),
    )
    algorithm_cls.check_plan(cfg.algo, plan.facts())
    # An engine may refuse a layout or a schedule it cannot run (e.g. the async engine: split layouts only).
    from spmd_rl import plugins
    engine_check = getattr(plugins.load_class(plugins.ENGINE, cfg.classes.get("engine", "sync")), "check_plan", None)
    if engine_check is not None:
        engine_check(cfg, topology, plan, schedule)
    return plan


def dry_run_plan(plan: Plan) -> Plan:
    """`--dry-run`: one real iteration, ending with a weight sync, so every role, channel and collective runs."""
    return replace(plan, num_iterations=1, sync_every=1, explore_iterations=0)


@dataclass
class Setup:
    """Everything an engine needs on one rank, resolved and validated before any process group existed."""
    cfg: Config
    plan: Plan
    runtime: Runtime
    topology: Topology
    groups: ProcessGroups
    spec: EnvSpec
    outputs: dict[str, StepField]        # the policy's declared per-step outputs
    run_dir: Path
    policy_cls: type[Policy]
    algorithm_cls: type[Algorithm]
    callback_classes: list               # [(class, config)]
    control: RunControl                  # the end-of-iteration agreement: checkpoints and stops
    resume: Resume                       # where the run starts (a checkpoint every rank loads, or iteration 0)
    final_policy: Policy | None = None   # rank 0's policy, saved as policy.pt at the end or on a stop

    @property
    def iterations(self) -> range:
        return range(self.resume.start_iteration, self.plan.num_iterations)

    def load_checkpoint(self) -> dict | None:
        """This rank's state in the checkpoint the run resumes from, or None for a fresh start."""
        if self.resume.checkpoint is None:
            return None
        return self.control.store.load(self.resume.checkpoint, self.runtime.rank, map_location=self.runtime.device)


def build_policy(cfg: Config, spec: EnvSpec, policy_cls: type[Policy], device: torch.device | str = "cpu") -> Policy:
    """The module inference ranks act with and trainer rank 0 broadcasts; the same initial module everywhere
    (trainer 0's is the one that counts)."""
    torch.manual_seed(cfg.train.seed)
    return policy_cls(spec.observation_space, spec.action_space, cfg.policy).to(device)


def make_context(setup: Setup, group) -> Context:
    rank, topology = setup.runtime.rank, setup.topology
    trainers = topology.trainer_ranks if not topology.colocated else list(range(setup.runtime.world_size))
    return Context(rank=rank, trainer_index=trainers.index(rank), num_trainers=len(trainers), group=group,
                   device=setup.runtime.device, timeout=setup.runtime.timeout, run_dir=setup.run_dir,
                   seed=setup.cfg.train.seed, num_iterations=setup.plan.num_iterations,
                   steps_per_iteration=setup.plan.steps_per_iteration,
                   observation_space=setup.spec.observation_space, action_space=setup.spec.action_space,
                   buffer=setup.cfg.buffer)


def make_experience_log(setup: Setup, rank: int):
    cfg = setup.cfg
    if not cfg.buffer.log_experience:
        return None
    from spmd_rl.storage.hdf5 import ExperienceLog
    example = segment_message(setup.spec, setup.outputs, setup.plan.num_steps, cfg.env.num_envs)["rollout"]
    return ExperienceLog(setup.run_dir, rank, example, chunk_rows=cfg.buffer.chunk_rows,
                         compression=cfg.buffer.h5_compression, flush_every_s=cfg.buffer.flush_every_s)


class Reporter:
    """Called after every iteration on every trainer: runs the callbacks; only the first trainer (global rank 0)
    logs."""

    def __init__(self, setup: Setup, logger: MetricsLogger | None, callbacks: list, policy: Policy):
        self.plan = setup.plan
        self.eval_cfg, self.env_cfg, self.seed = setup.cfg.eval, setup.cfg.env, setup.cfg.train.seed
        self.logger = logger
        self.callbacks = callbacks
        self.policy = policy

    def __call__(self, iteration: int, metrics: dict, statistics: dict | None, trainer: Trainer) -> None:
        env_steps = (iteration + 1) * self.plan.steps_per_iteration
        logs = self.logger is not None and statistics is not None
        if logs:  # the whole metrics.jsonl line, periodic evaluation included, is what the callbacks see here
            if self.eval_cfg.every and (iteration + 1) % self.eval_cfg.every == 0:
                metrics = {**metrics, **self.evaluate(iteration)}
            times = {"time_learn_s": trainer.learn_s, "time_weight_sync_s": trainer.weight_sync_s}
            record = self.logger.record(iteration, env_steps, metrics, statistics, times)
        else:
            record = {"iteration": iteration, "env_steps": env_steps, **metrics}
        for callback in self.callbacks:
            extra = callback.on_iteration_end(iteration, dict(record), trainer.algorithm)
            if extra:
                record.update({key: float(value) for key, value in extra.items()})
        if logs:
            self.logger.write(record)

    def evaluate(self, iteration: int) -> dict[str, float]:
        """Episodes on envs of their own, with a generator of their own: training's RNG streams are untouched."""
        from spmd_rl.evaluate import evaluate
        result = evaluate(self.policy, self.env_cfg, self.eval_cfg.episodes, seed=self.seed * 1_000_003 + iteration,
                          deterministic=self.eval_cfg.deterministic)
        return {"eval_return_mean": result["return_mean"], "eval_return_std": result["return_std"],
                "eval_length_mean": result["length_mean"]}


class SyncEngine(Engine):
    """The sync engine: every rank runs the story of its role; weights move at fixed points between rollouts."""

    def run(self, setup: Setup) -> Policy | None:
        topology, rank = setup.topology, setup.runtime.rank

        def run_role(logger: MetricsLogger | None) -> None:
            if topology.colocated:
                _run_colocated(setup, logger)
            elif topology.role_of(rank) == ENV:
                _run_env(setup)
            elif topology.role_of(rank) == INFERENCE:
                _run_inference(setup)
            else:
                _run_trainer(setup, logger)

        return run_with_metrics(setup, run_role)


def run_with_metrics(setup: Setup, run_role) -> Policy | None:
    """Run this rank's role, run_role(logger), with rank 0 logging metrics.jsonl (logger None elsewhere); the
    logger writes its summary only when the role finished. Returns the policy trainer rank 0 saves."""
    logger = None
    if setup.runtime.rank == 0:
        plan, log = setup.plan, setup.cfg.log
        logger = MetricsLogger(setup.run_dir, plan.num_iterations * plan.steps_per_iteration, log.progress,
                               log.interval_s, log.tensorboard,
                               resumed_env_steps=setup.resume.start_iteration * plan.steps_per_iteration)
    finished = False
    try:
        run_role(logger)
        finished = True
    finally:
        if logger is not None:
            logger.close(summary=finished)
    return setup.final_policy


def save_policy(policy: Policy, run_dir: Path) -> None:
    from spmd_rl.fileio import torch_save_atomic
    # Clones: with a weight sync, tensors of several dtypes are views of one byte bucket, which torch.save
    # refuses; the file should hold plain tensors anyway.
    torch_save_atomic({k: v.detach().clone() for k, v in policy.state_dict().items()}, run_dir / "policy.pt")


def mark_finished(run_dir: Path) -> None:
    """A finished run's directory is never resumed (run_control.decide_resume)."""
    import json

    from spmd_rl.fileio import write_atomic
    from spmd_rl.run_control import FINISHED
    write_atomic(run_dir / FINISHED, json.dumps({"finished": True}) + "\n")


def _seed_rank(cfg: Config, rank: int) -> int:
    # Distinct, reproducible streams per rank: each rank's envs get seeds seed*1000003 + rank*num_envs + i.
    torch.manual_seed(cfg.train.seed * 1_000_003 + rank)
    return cfg.train.seed * 1_000_003 + rank * cfg.env.num_envs


def _build_algorithm(setup: Setup, policy: Policy, group) -> tuple[Algorithm, list]:
    context = make_context(setup, group)
    algorithm = setup.algorithm_cls(policy, setup.cfg.algo, context)
    callbacks = [cls(config, context) for cls, config in setup.callback_classes]
    return algorithm, callbacks


def _uniform_actions(setup: Setup) -> UniformActions | None:
    return UniformActions(setup.spec.action_space, setup.outputs) if setup.plan.explore_iterations else None


def _run_colocated(setup: Setup, logger) -> Policy:
    """Every rank: its own envs, its own policy copy, data-parallel learning across ranks. The roles take turns
    in this process, through local channels."""
    cfg, plan, runtime, spec = setup.cfg, setup.plan, setup.runtime, setup.spec
    device, rank = runtime.device, runtime.rank
    group = setup.groups.trainer if runtime.world_size > 1 else None
    policy = build_policy(cfg, spec, setup.policy_cls, device)
    algorithm, callbacks = _build_algorithm(setup, policy, group)
    envs, first_obs = make_vector_env(cfg.env, spec, _seed_rank(cfg, rank))
    n, t = cfg.env.num_envs, plan.num_steps
    obs_out, obs_in = local_channel("observations", observation_message(spec, n))
    actions_out, actions_in = local_channel("actions", action_message(setup.outputs, n))
    segments_out, segments_in = local_channel("segments", segment_message(spec, setup.outputs, t, n))
    worker = EnvWorker(envs, first_obs, obs_out, actions_in, segments_out, t, list(setup.outputs),
                       describe=f"rank {rank}", env_id=cfg.env.id)
    server = InferenceServer(policy, [obs_in], [actions_out], device, uniform_actions=_uniform_actions(setup))
    trainer = Trainer(algorithm, [segments_in], [f"rank {rank}"], plan.max_env_columns_per_trainer * t, group,
                      experience_log=make_experience_log(setup, rank), describe=f"rank {rank}",
                      timeout=runtime.timeout, skip_nonfinite_updates=cfg.train.skip_nonfinite_updates)
    report = Reporter(setup, logger, callbacks, policy)
    _say_if_env_state_unsaved(setup, worker)
    state = setup.load_checkpoint()
    if state is None:
        _init_from(setup, policy, algorithm)
    else:
        _restore_trainer(state, policy, trainer, logger)
        _restore_env(state, worker)
        restore_rng_state(state["rng"])  # last: building the envs above drew from the generators
    if rank == 0:
        setup.final_policy = policy

    def capture() -> dict:
        return {**_trainer_state(policy, trainer, logger), **_env_state(worker)}

    try:
        for iteration in setup.iterations:
            # The module is shared with the trainer: every step acts with the latest weights.
            server.policy_version = plan.version_at(iteration)
            server.explore_uniformly = plan.explores_at(iteration)
            for step in range(t):
                worker.send_observations(step)
                server.serve_step()
                worker.receive_actions_and_step(step)
            worker.send_segment()
            segment = trainer.receive_segments(expected_version=plan.version_at(iteration))
            losses = trainer.learn(segment, iteration)
            report(iteration, losses, trainer.gather_statistics(segment), trainer)
            setup.control.after_iteration(iteration, capture)
    finally:  # files are flushed and closed on every way out
        worker.close()
        trainer.close()
    return policy


def build_env_worker(setup: Setup, observation_layout=observation_message) -> EnvWorker:
    """A split-layout env rank's worker: its envs, its channels (observations to its inference rank and actions
    back, segments to its trainer), restored from the checkpoint the run resumes from. observation_layout(spec,
    num_envs) is the observation message's layout (both engines share everything else)."""
    cfg, plan, topology, spec = setup.cfg, setup.plan, setup.topology, setup.spec
    rank = setup.runtime.rank
    inference, trainer = topology.env_to_inference[rank], topology.env_to_trainer[rank]
    n, t = cfg.env.num_envs, plan.num_steps
    envs, first_obs = make_vector_env(cfg.env, spec, _seed_rank(cfg, rank))
    (to_inference, to_trainer), (from_inference,) = open_channels(
        me=rank,
        sends=[(inference, "observations", observation_layout(spec, n)),
               (trainer, "segments", segment_message(spec, setup.outputs, t, n))],
        recvs=[(inference, "actions", action_message(setup.outputs, n))],
        describe_rank=topology.describe, timeout=setup.runtime.timeout)
    worker = EnvWorker(envs, first_obs, to_inference, from_inference, to_trainer, t, list(setup.outputs),
                       describe=topology.describe(rank), env_id=cfg.env.id)
    _say_if_env_state_unsaved(setup, worker)
    state = setup.load_checkpoint()
    if state is not None:
        _restore_env(state, worker)
        restore_rng_state(state["rng"])
    return worker


def _run_env(setup: Setup) -> None:
    worker = build_env_worker(setup)
    run_env_rank(worker, setup.iterations,
                 lambda iteration: setup.control.after_iteration(iteration, lambda: _env_state(worker)))


def _weight_sync(setup: Setup, policy: Policy) -> WeightSync:
    topology, runtime = setup.topology, setup.runtime
    return WeightSync(policy, setup.groups.weights, src=topology.trainer_ranks[0], me=runtime.rank,
                      bucket_bytes=int(setup.cfg.weights.bucket_mb * 2**20), timeout=runtime.timeout,
                      describe_rank=topology.describe)


def _run_inference(setup: Setup) -> Policy:
    cfg, plan, topology, runtime = setup.cfg, setup.plan, setup.topology, setup.runtime
    rank = runtime.rank
    served = topology.envs_served_by(rank)
    n = cfg.env.num_envs
    policy = build_policy(cfg, setup.spec, setup.policy_cls, runtime.device)
    weight_sync = _weight_sync(setup, policy)
    _seed_rank(cfg, rank)
    action_channels, obs_channels = open_channels(
        me=rank,
        sends=[(env, "actions", action_message(setup.outputs, n)) for env in served],
        recvs=[(env, "observations", observation_message(setup.spec, n)) for env in served],
        describe_rank=topology.describe, timeout=runtime.timeout)
    server = InferenceServer(policy, obs_channels, action_channels, runtime.device, weight_sync,
                             uniform_actions=_uniform_actions(setup))
    state = setup.load_checkpoint()
    if state is not None:
        restore_rng_state(state["rng"])  # the weights come from trainer 0
    run_inference_rank(server, plan, plan.num_steps, cfg.weights.verify_every, setup.iterations,
                       lambda iteration: setup.control.after_iteration(iteration, dict))
    return policy


def _run_trainer(setup: Setup, logger) -> Policy:
    cfg, plan, topology, runtime = setup.cfg, setup.plan, setup.topology, setup.runtime
    rank = runtime.rank
    sources = topology.envs_trained_by(rank)
    n, t = cfg.env.num_envs, plan.num_steps
    group = setup.groups.trainer if len(topology.trainer_ranks) > 1 else None
    policy = build_policy(cfg, setup.spec, setup.policy_cls, runtime.device)
    # Built before the optimizer and DDP: it points the parameters into its flat buckets.
    weight_sync = _weight_sync(setup, policy) if rank == topology.trainer_ranks[0] else None
    algorithm, callbacks = _build_algorithm(setup, policy, group)
    _seed_rank(cfg, rank)
    _, segment_channels = open_channels(
        me=rank, sends=[],
        recvs=[(env, "segments", segment_message(setup.spec, setup.outputs, t, n)) for env in sources],
        describe_rank=topology.describe, timeout=runtime.timeout)
    trainer = Trainer(algorithm, segment_channels, [topology.describe(e) for e in sources],
                      plan.max_env_columns_per_trainer * t, group, weight_sync,
                      make_experience_log(setup, rank), describe=topology.describe(rank), timeout=runtime.timeout,
                      skip_nonfinite_updates=cfg.train.skip_nonfinite_updates)
    state = setup.load_checkpoint()
    if state is None:
        _init_from(setup, policy, algorithm)
    else:
        _restore_trainer(state, policy, trainer, logger)
        restore_rng_state(state["rng"])
    if rank == 0:
        setup.final_policy = policy
    try:
        run_trainer_rank(trainer, plan, cfg.weights.verify_every, Reporter(setup, logger, callbacks, policy),
                         setup.iterations,
                         lambda iteration: setup.control.after_iteration(
                             iteration, lambda: _trainer_state(policy, trainer, logger)))
    finally:  # files are flushed and closed on every way out
        trainer.close()
    return policy


# ---------------------------------------------------------------------------------------------------------------
# What each role puts in a checkpoint (RunControl adds the iteration and every generator's state)


def _init_from(setup: Setup, policy: Policy, algorithm: Algorithm) -> None:
    """run.init_from: a new run starts from trained weights (and, with run.init_algorithm, the algorithm's state)."""
    run = setup.cfg.run
    if not run.init_from:
        return
    from spmd_rl.evaluate import read_trained_state
    policy_state, algorithm_state = read_trained_state(run.init_from, with_algorithm=run.init_algorithm)
    try:
        policy.load_state_dict(policy_state)
        if algorithm_state is not None:
            algorithm.load_state_dict(algorithm_state)
    except (RuntimeError, KeyError, ValueError) as exc:
        raise UserError(f"run.init_from={run.init_from}: its state does not fit policy.class "
                        f"'{setup.cfg.classes['policy']}' / algo.class '{setup.cfg.classes['algo']}' with this "
                        f"config: {' '.join(str(exc).split())[:300]}") from None


def _trainer_state(policy: Policy, trainer: Trainer, logger) -> dict:
    log = trainer.experience_log
    return {
        "policy": {k: v.detach().clone() for k, v in policy.state_dict().items()},
        "algorithm": trainer.algorithm.state_dict(),
        "experience_rows": log.total_rows if log is not None else -1,
        "metrics": logger.state_dict() if logger is not None else {},
    }


def _restore_trainer(state: dict, policy: Policy, trainer: Trainer, logger) -> None:
    policy.load_state_dict(state["policy"])
    trainer.algorithm.load_state_dict(state["algorithm"])
    if trainer.experience_log is not None:
        trainer.experience_log.rewind(state["experience_rows"])
    if logger is not None:
        logger.load_state_dict(state["metrics"])


def _env_state(worker: EnvWorker) -> dict:
    return {"env": capture_env_state(worker.envs), "worker": worker.state_dict()}


def _say_if_env_state_unsaved(setup: Setup, worker: EnvWorker) -> None:
    """Once per run (the first rank with envs): a checkpoint cannot hold these envs' state, so a resume begins
    fresh episodes."""
    first = 0 if setup.topology.colocated else setup.topology.env_ranks[0]
    reason = unsaved_env_reason(worker.envs) if setup.runtime.rank == first else None
    if reason:
        print(f"spmd_rl: note: {reason}", flush=True)


def _restore_env(state: dict, worker: EnvWorker) -> None:
    # Envs whose state cannot be saved begin fresh episodes (said at start); the rest continue exactly.
    if state["env"] is not None:
        restore_env_state(worker.envs, state["env"])
        worker.load_state_dict(state["worker"])
