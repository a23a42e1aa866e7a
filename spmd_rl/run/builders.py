"""The builders of a run's role components (`Run.build_colocated`, `build_env_runner`, `build_inference_server`,
`inference_parts`, `build_trainer` call them): each hands out a component ready to use, its channels open; its
state comes from `Run.restore`, which the engine calls with every component it runs.

Every builder keeps one order of the steps that draw random numbers (policy, algorithm, the rank's seed, envs),
and Run.restore sets the checkpoint's generators after them, which is what makes a resumed run continue exactly.
Over 400 lines: the builders share their helpers (seeding, the algorithm's context, run.init_from), hence one
file; who sends the weights how is run/weight_sync_plan.py's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from spmd_rl.comm import sharding
from spmd_rl.comm.channel_setup import open_channels
from spmd_rl.comm.local_channel import local_channel
from spmd_rl.comm.weight_sources import GatheredWeightSource
from spmd_rl.comm.weights import WeightSync
from spmd_rl.envs.backend import backend_for
from spmd_rl.envs.vector import group_of_envs
from spmd_rl.interfaces.algorithm import Algorithm, PolicyMethod
from spmd_rl.interfaces.context import Context
from spmd_rl.interfaces.policy import GROUP, Policy
from spmd_rl.modules.pretrained import WeightSource, read_rows, reading_deferred
from spmd_rl.roles.env_runner import EnvRunner
from spmd_rl.roles.env_step_thread import EnvStepThread
from spmd_rl.roles.inference_server import InferenceParts, InferenceServer, RecurrentStates, UniformActions
from spmd_rl.roles.local_env_runner import local_env_runner
from spmd_rl.roles.messages import (
    action_message,
    observation_message,
    segment_message,
    stage_channel,
    stage_name,
    with_episode_starts,
)
from spmd_rl.roles.pipelined_env_runner import PipelinedEnvRunner, stage_columns, stage_seed
from spmd_rl.roles.trainer import Trainer
from spmd_rl.run.evaluation import cuda_indices
from spmd_rl.run.metrics import MetricsLogger
from spmd_rl.run.policies import (
    build_policy,
    cpu_copy,
    policy_on_meta,
    policy_tensors,
    policy_to_receive,
    read_trained_state,
    trained_state_source,
    trainers_read_own_rows,
)
from spmd_rl.run.report import Reporter
from spmd_rl.run.state_fit import load_fitted
from spmd_rl.run.weight_sync_plan import WeightSyncPlan
from spmd_rl.runtime.errors import SharedUserError, UserError
from spmd_rl.runtime.watchdog import COLLECTIVE_MARGIN_S, watchdog
from spmd_rl.storage.experience_log import ExperienceLog

if TYPE_CHECKING:  # annotations only: the run hands itself to its builders
    from spmd_rl.run.run import Run


def policy_device(policy: Policy) -> str:
    return next(iter(policy.state_dict().values()), torch.empty(0)).device.type


def build_colocated(
    run: Run, logger: MetricsLogger | None
) -> tuple[EnvRunner | PipelinedEnvRunner, InferenceServer, Trainer, Reporter]:
    """Run.build_colocated (its docstring says what it builds)."""
    cfg, plan, rank = run.cfg, run.plan, run.rank
    group = run.groups.trainer if run.runtime.world_size > 1 else None
    with watchdog.watch(f"building policy.class {cfg.classes['policy']}"):
        policy = build_policy(cfg, run.spec, run.policy_class(), run.runtime.device)
    initial_algorithm_state = _init_policy_from(run, policy)
    algorithm, callbacks = _build_algorithm(run, policy, group)
    n, t, stages = cfg.env.num_envs, plan.num_steps, cfg.env.pipeline_stages
    columns = stage_columns(n, stages)
    segments = local_channel("segments", segment_message(run.spec, run.outputs, t, n, run.recurrent_state))
    # With stages, each stage's envs step on a thread of their own while this thread acts for the next stage.
    stage_runners = [
        local_env_runner(
            envs,
            first_obs,
            run.spec,
            run.outputs,
            t,
            run.recurrent_state,
            segments,
            step_thread=None if stages == 1 else EnvStepThread(envs, f"env step{stage_name(s, stages)}"),
            **_env_runner_options(run, f"rank {rank}", columns, s),
        )
        for s, (envs, first_obs) in enumerate(_make_stage_envs(run, _seed_rank(run), columns))
    ]
    runner = (
        stage_runners[0].runner
        if stages == 1
        else PipelinedEnvRunner([local.runner for local in stage_runners], segments[0], n)
    )
    server = InferenceServer(
        policy,
        [local.observations for local in stage_runners],
        [local.actions for local in stage_runners],
        run.runtime.device,
        uniform_actions=_uniform_actions(run),
        states=_recurrent_states(run, [n // stages] * stages),
        stages=stages,
    )
    trainer = Trainer(
        algorithm,
        [segments[1]],
        [f"rank {rank}"],
        plan.max_env_columns_per_trainer * t,
        group,
        experience_log=_experience_log(run),
        describe=f"rank {rank}",
        timeout=run.runtime.timeout,
        skip_nonfinite_updates=cfg.train.skip_nonfinite_updates,
        policy=policy,
        column_groups=_column_groups(run, 1),
        sharded=plan.parallel.sharded,
    )
    report = Reporter(cfg, plan, logger, callbacks, policy)
    _say_if_env_state_unsaved(run, runner)
    if run.resume.checkpoint is None:
        _init_algorithm_from(run, algorithm, initial_algorithm_state)
    if rank == 0:
        run.final_policy = _final_policy(run, trainer, policy)
    return runner, server, trainer, report


def build_env_runner(run: Run, observation_layout=observation_message) -> EnvRunner | PipelinedEnvRunner:
    """Run.build_env_runner (its docstring says what it builds)."""
    cfg, topology, spec, rank = run.cfg, run.topology, run.spec, run.rank
    inference, trainer = topology.env_to_inference[rank], topology.env_to_trainer[rank]
    n, t, stages = cfg.env.num_envs, run.plan.num_steps, cfg.env.pipeline_stages
    columns = stage_columns(n, stages)
    state = run.recurrent_state
    stage_envs = _make_stage_envs(run, _seed_rank(run), columns)
    channels, from_inference = open_channels(
        me=rank,
        sends=[
            *(
                (
                    inference,
                    stage_channel("observations", s, stages),
                    with_episode_starts(observation_layout(spec, n // stages), state, n // stages),
                )
                for s in range(stages)
            ),
            (trainer, "segments", segment_message(spec, run.outputs, t, n, state)),
        ],
        recvs=[
            (inference, stage_channel("actions", s, stages), action_message(run.outputs, n // stages, state))
            for s in range(stages)
        ],
        describe_rank=topology.describe,
        timeout=run.runtime.timeout,
    )
    *to_inference, to_trainer = channels
    runners = [
        EnvRunner(
            envs,
            first_obs,
            to_inference[s],
            from_inference[s],
            to_trainer,
            t,
            list(run.outputs),
            **_env_runner_options(run, run.describe(), columns, s),
        )
        for s, (envs, first_obs) in enumerate(stage_envs)
    ]
    runner = runners[0] if stages == 1 else PipelinedEnvRunner(runners, to_trainer, n)
    _say_if_env_state_unsaved(run, runner)
    return runner


def _env_runner_options(run: Run, describe: str, columns: list[slice], stage: int) -> dict:
    """The EnvRunner keywords of pipeline stage `stage` of `columns` (the one stage: its whole segment)."""
    stages = len(columns)
    backend = backend_for(run.cfg.env)
    return {
        "describe": describe,
        "env_id": run.cfg.env.id,
        "env_backend": backend,
        "hang_advice": backend.hang_advice(_stage_section(run, stages), run.spec),
        "success_key": run.spec.success_key,
        "group_size": run.cfg.env.group_size,
        "columns": None if stages == 1 else columns[stage],
        "stage": stage_name(stage, stages),
    }


def _make_stage_envs(run: Run, seed: int, columns: list[slice]) -> list[tuple]:
    """Each pipeline stage's vector env and first observations (one stage: the rank's envs), every env seeded as it
    is in one stage (stage_seed)."""
    cfg, stages = run.cfg, len(columns)
    stage_envs = []
    section = _stage_section(run, stages)
    backend = backend_for(section)
    advice = backend.hang_advice(section, run.spec)
    for stage, envs_of_stage in enumerate(columns):
        with watchdog.watch(f"making and resetting env.id {cfg.env.id}{stage_name(stage, stages)}{advice}"):
            stage_envs.append(backend.make(section, run.spec, stage_seed(seed, envs_of_stage, cfg.env.group_size)))
    return stage_envs


def _stage_section(run: Run, stages: int):
    """The env section of one pipeline stage's vector env: env.num_envs / stages envs."""
    return dataclasses.replace(run.cfg.env, num_envs=run.cfg.env.num_envs // stages)


def build_inference_server(run: Run) -> InferenceServer:
    """Run.build_inference_server (its docstring says what it builds)."""
    parts = inference_parts(run)
    return InferenceServer(
        parts.policy,
        parts.obs_channels,
        parts.action_channels,
        run.runtime.device,
        parts.weight_sync,
        uniform_actions=parts.uniform_actions,
        states=parts.states,
        stages=parts.stages,
    )


def inference_parts(run: Run, observation_layout=observation_message, recv_buffers: int = 1) -> InferenceParts:
    """Run.inference_parts (its docstring says what it builds)."""
    cfg, topology, rank = run.cfg, run.topology, run.rank
    stages = cfg.env.pipeline_stages
    # Its clients: every served env rank's stages, stage by stage (each stage of each env rank has its channels).
    clients = [(env, s) for s in range(stages) for env in topology.envs_served_by(rank)]
    n = cfg.env.num_envs // stages
    state_fields = run.recurrent_state
    with watchdog.watch(f"building policy.class {cfg.classes['policy']}"):
        policy = policy_to_receive(cfg, run.spec, run.policy_class(), run.runtime.device)
    weights = WeightSyncPlan.of(run)
    if weights.wire_dtype == torch.bfloat16:  # this rank's copy in the wire's dtype; it acts under autocast
        sharding.compute_in_bf16(sharding.cast_parameters(policy, torch.bfloat16), ["act"], policy_device(policy))
    weight_sync = weights.inference_member(run, policy)
    _seed_rank(run)
    observations = [with_episode_starts(observation_layout(run.spec, n), state_fields, n) for _ in clients]
    action_channels, obs_channels = open_channels(
        me=rank,
        sends=[
            (env, stage_channel("actions", s, stages), action_message(run.outputs, n, state_fields))
            for env, s in clients
        ],
        recvs=[
            (env, stage_channel("observations", s, stages), layout) for (env, s), layout in zip(clients, observations)
        ],
        describe_rank=topology.describe,
        timeout=run.runtime.timeout,
        num_recv_buffers=recv_buffers,
    )
    states = _recurrent_states(run, [n] * len(clients))
    return InferenceParts(
        policy,
        weight_sync,
        obs_channels,
        action_channels,
        _uniform_actions(run),
        [topology.describe(env) + stage_name(s, stages) for env, s in clients],
        states,
        stages,
    )


def build_trainer(run: Run, logger: MetricsLogger | None, recv_buffers: int = 1) -> tuple[Trainer, Reporter]:
    """Run.build_trainer (its docstring says what it builds)."""
    cfg, plan, topology, rank = run.cfg, run.plan, run.topology, run.rank
    sources = topology.envs_trained_by(rank)
    n, t = cfg.env.num_envs, plan.num_steps
    # A sharded policy needs its trainers' own group even when there is one trainer: the device mesh FSDP shards
    # over is the trainer group's, never the world's (the inference and env ranks hold no rows).
    group = run.groups.trainer if len(topology.trainer_ranks) > 1 or plan.parallel.sharded else None
    on_meta = _policy_on_meta(run, group)
    source = None  # trainer 0's built policy, whose values the trainers' shards take (policy on the meta device)
    own_rows = on_meta is not None and trainers_read_own_rows(cfg, True, run.algorithm_cls)
    if on_meta is None:
        policy = _trainer_policy(run)
    else:
        policy = on_meta
        source = _trainer_policy(run, own_rows) if rank == topology.trainer_ranks[0] else None
    with warnings.catch_warnings():  # run.init_from into the meta device: checked, and copied nowhere
        warnings.filterwarnings("ignore", message=r".*copying from a non-meta parameter .* to a meta parameter")
        initial_algorithm_state = _init_policy_from(run, source if source is not None else policy)
    files = on_meta.file_sources() if on_meta is not None and own_rows else {}
    materialise = None if on_meta is None else _shards_from_trainer_0(run, group, source, files)
    source = None  # materialise holds it until the shards are filled, then lets it go
    weights = WeightSyncPlan.of(run)
    weight_sync: WeightSync | GatheredWeightSource | None
    if weights.gathered:  # after sharding: every trainer takes part
        algorithm, callbacks = _build_algorithm(run, policy, group, materialise)
        if any(p.is_meta for p in policy.parameters()):
            raise UserError(
                f"algo.class '{cfg.classes['algo']}' says it takes the policy on the meta device "
                f"(takes_policy_on_meta), but its constructor did not lay it out with Context.data_parallel, which "
                f"gives it its values; return False from takes_policy_on_meta or call data_parallel"
            )
        weight_sync = weights.trainer_member(run, policy)
    else:  # before the optimizer and DDP: it points the parameters into its flat buckets
        weight_sync = weights.trainer_member(run, policy)
        algorithm, callbacks = _build_algorithm(run, policy, group)
    _seed_rank(run)
    _, segment_channels = open_channels(
        me=rank,
        sends=[],
        recvs=[(env, "segments", segment_message(run.spec, run.outputs, t, n, run.recurrent_state)) for env in sources],
        describe_rank=topology.describe,
        timeout=run.runtime.timeout,
        num_recv_buffers=recv_buffers,
    )
    trainer = Trainer(
        algorithm,
        segment_channels,
        [topology.describe(e) for e in sources],
        plan.max_env_columns_per_trainer * t,
        group,
        weight_sync,
        _experience_log(run),
        describe=run.describe(),
        timeout=run.runtime.timeout,
        skip_nonfinite_updates=cfg.train.skip_nonfinite_updates,
        policy=policy,
        column_groups=_column_groups(run, len(sources)),
        sharded=plan.parallel.sharded,
    )
    report = Reporter(cfg, plan, logger, callbacks, policy)
    if run.resume.checkpoint is None:
        _init_algorithm_from(run, algorithm, initial_algorithm_state)
    if rank == 0:
        run.final_policy = _final_policy(run, trainer, policy)
    return trainer, report


# -- the parts the builders share ------------------------------------------------------------------------------


def _seed_rank(run: Run) -> int:
    # Distinct, reproducible streams per rank: each rank's envs get seeds seed*1000003 + rank*num_envs + i.
    cfg = run.cfg
    torch.manual_seed(cfg.train.seed * 1_000_003 + run.rank)
    return cfg.train.seed * 1_000_003 + run.rank * cfg.env.num_envs


def _context(run: Run, group) -> Context:
    topology = run.topology
    trainers = topology.trainer_ranks if not topology.colocated else list(range(run.runtime.world_size))
    return Context(
        rank=run.rank,
        trainer_index=trainers.index(run.rank),
        num_trainers=len(trainers),
        group=group,
        device=run.runtime.device,
        timeout=run.runtime.timeout,
        run_dir=run.run_dir,
        seed=run.cfg.train.seed,
        num_iterations=run.plan.num_iterations,
        steps_per_iteration=run.plan.steps_per_iteration,
        observation_space=run.spec.observation_space,
        action_space=run.spec.action_space,
        buffer=run.cfg.buffer,
        parallel=run.cfg.train.parallel,
        precision=run.cfg.train.precision,
        activation_checkpointing=run.cfg.train.activation_checkpointing,
        policy_methods=(
            "act",
            *(m.name if isinstance(m, PolicyMethod) else m for m in run.algorithm_cls.policy_methods),
        ),
        hybrid_shards=(
            (run.groups.replicate, run.groups.shard, run.groups.shard_mesh) if run.groups.shard_mesh else None
        ),
        group_size=run.cfg.env.group_size,
    )


def _trainer_policy(run: Run, files_deferred: bool = False) -> Policy:
    """The policy a trainer builds, or takes from its checks before start (which called act on it); files_deferred:
    without reading its file_sources, whose values the sharded trainers read themselves (trainers_read_own_rows)."""
    prebuilt, run.prebuilt = run.prebuilt, None
    if prebuilt is not None and prebuilt.files_deferred == files_deferred:
        return prebuilt.take(run.runtime.device)
    # (a prebuilt policy whose file tensors are zeros, where the trainers cannot shard it on the meta device after
    # all, is built again, reading them)
    with watchdog.watch(f"building policy.class {run.cfg.classes['policy']}"):
        with reading_deferred() if files_deferred else contextlib.nullcontext():
            return build_policy(run.cfg, run.spec, run.policy_class(), run.runtime.device)


def _policy_on_meta(run: Run, group) -> Policy | None:
    """A sharded trainer's policy on the meta device, where its algorithm takes it so (Algorithm.
    takes_policy_on_meta) and its class builds there; None: the trainer builds it as before."""
    if not (run.plan.parallel.sharded and group is not None and run.algorithm_cls.takes_policy_on_meta(run.cfg.algo)):
        return None
    try:
        return policy_on_meta(run.cfg, run.spec, run.policy_class())
    except Exception:  # a constructor that needs real tensors (the same class fails alike on every trainer)
        return None


def _shards_from_trainer_0(
    run: Run, group, source: Policy | None, files: dict[str, WeightSource]
) -> Callable[[nn.Module], None]:
    """What Context.data_parallel calls once the meta policy is sharded: its tensors on the device, each trainer's
    own rows of trainer 0's built policy (`source`; None elsewhere), sent tensor by tensor (sharding.fill_shards),
    so that the weights are those of the policy built whole, and no other trainer builds or holds it; the tensors
    `files` names (the policy's file_sources, when trainers_read_own_rows) each trainer reads its own rows of from
    the files instead. torch's random state is trainer 0's after its build on every trainer, as when each built it
    (sent now, before the algorithm draws any)."""
    src = run.topology.trainer_ranks[0]
    rng = torch.get_rng_state()
    dist.broadcast(rng, src=src, group=group)
    torch.set_rng_state(rng)
    held = [source]

    def materialise(module: nn.Module) -> None:
        module.to_empty(device=run.runtime.device)
        whole = held.pop()
        tensors = None if whole is None else dict(policy_tensors(whole))
        with watchdog.watch("giving the sharded policy its values from trainer 0", COLLECTIVE_MARGIN_S):
            readers: dict[str, Callable[[int, int], torch.Tensor]] = {
                name: functools.partial(read_rows, where) for name, where in files.items()
            }
            sharding.fill_shards(module, tensors, group, src, readers)

    return materialise


def _build_algorithm(run: Run, policy: Policy, group, materialise=None) -> tuple[Algorithm, list]:
    context = dataclasses.replace(_context(run, group), materialise=materialise)
    with watchdog.watch(f"building algo.class {run.cfg.classes['algo']} and the callbacks", COLLECTIVE_MARGIN_S):
        algorithm = run.algorithm_cls(policy, run.cfg.algo, context)
        callbacks = [cls(config, context) for cls, config in run.callback_classes]
    return algorithm, callbacks


def _final_policy(run: Run, trainer: Trainer, policy: Policy) -> Policy | None:
    """What rank 0 saves as policy.pt: the policy itself, or when the trainers shard it a plain copy on the CPU,
    made when the full weights are first gathered into it (Trainer.whole_policy: the first checkpoint or
    evaluation; the run's last iteration checkpoints), not at start, where it took seconds before the first
    iteration. Not a second construction where the class builds on the meta device (policies.cpu_copy); its
    buffers (non-persistent ones too, which no state dict holds) are the policy's own, which sharding leaves whole."""
    if not trainer.sharded:
        return policy

    def make() -> Policy:
        run.final_policy = cpu_copy(
            policy, run.cfg, run.spec, run.policy_class(), cuda_indices(run.runtime.device), parameters=False
        )
        return run.final_policy

    trainer.make_final_copy = make
    return None


def _recurrent_states(run: Run, counts: list[int]) -> RecurrentStates | None:
    """Where an inference server keeps a recurrent policy's state: one row per env it acts for."""
    fields = run.recurrent_state
    return None if fields is None else RecurrentStates(fields, counts, run.runtime.device)


def _column_groups(run: Run, env_ranks: int) -> torch.Tensor | None:
    """With env groups, the group of every env column a trainer receives from `env_ranks` env ranks (each
    rank's envs are the groups' envs in order); None without groups."""
    if not run.cfg.env.groups:
        return None
    return torch.from_numpy(np.tile(group_of_envs(run.cfg.env), env_ranks))


def _uniform_actions(run: Run) -> UniformActions | None:
    return UniformActions(run.spec.action_space, run.outputs) if run.plan.explore_iterations else None


def _experience_log(run: Run) -> ExperienceLog | None:
    buffer = run.cfg.buffer
    if not buffer.log_experience:
        return None
    example = segment_message(run.spec, run.outputs, run.plan.num_steps, run.cfg.env.num_envs, run.recurrent_state)[
        "rollout"
    ]
    groups = run.cfg.env.group_names()
    if groups:  # the column Trainer.learn adds to what it logs
        example[GROUP] = torch.zeros(example.batch_size, dtype=torch.int16)
    return ExperienceLog(
        run.run_dir,
        run.rank,
        example,
        chunk_rows=buffer.chunk_rows,
        compression=buffer.h5_compression,
        flush_every_s=buffer.flush_every_s,
        group_names=groups,
        must_exist=run.resume.checkpoint is not None,
    )


def _init_policy_from(run: Run, policy: Policy) -> dict | None:
    """run.init_from: a new run starts from trained or pretrained weights, loaded into the policy as it is built
    (before DDP or sharding wraps it); returns the algorithm's state for _init_algorithm_from when
    run.init_algorithm asks for it. Nothing when the run resumes: the checkpoint has the weights."""
    section = run.cfg.run
    if not section.init_from:
        if section.init_prefix:
            raise UserError(f"run.init_prefix={section.init_prefix} needs run.init_from (the file to load)")
        return None
    if section.init_prefix and section.init_algorithm:
        raise UserError(
            "run.init_prefix loads a part of the policy, and run.init_algorithm=true the algorithm's state "
            "for the whole of it: use one of them"
        )
    if section.init_algorithm and run.plan.parallel.sharded:
        raise UserError(
            "run.init_algorithm=true with train.parallel=fsdp is not supported (the optimizer state would have "
            "to be resharded from a whole copy); start from the weights only, or resume the run instead"
        )
    if run.resume.checkpoint is not None:
        return None
    # Every rank that builds the policy reads the same file and fails alike: rank 0 (a trainer) says it once.
    try:
        policy_state, algorithm_state = read_trained_state(section.init_from, with_algorithm=section.init_algorithm)
    except UserError as exc:
        raise SharedUserError(str(exc)) from None
    try:
        loaded = load_fitted(policy, policy_state, section.init_prefix)
    except UserError as exc:
        raise SharedUserError(
            f"run.init_from={section.init_from}: its weights do not fit policy.class "
            f"'{run.cfg.classes['policy']}': {exc}"
        ) from None
    if run.rank == 0:
        source = trained_state_source(section.init_from, section.init_algorithm)
        into = f" (prefix {section.init_prefix})" if section.init_prefix else ""
        with_state = "; the algorithm's state too (run.init_algorithm)" if algorithm_state is not None else ""
        print(
            f"spmd_rl: run.init_from: loaded {loaded} tensors from {source} into the policy{into}{with_state}",
            flush=True,
        )
    return algorithm_state


def _init_algorithm_from(run: Run, algorithm: Algorithm, state: dict | None) -> None:
    """run.init_algorithm: the algorithm's state from run.init_from's checkpoint (a fresh run only)."""
    if state is None:
        return
    try:
        algorithm.load_state_dict(state)
    except (RuntimeError, KeyError, ValueError) as exc:
        raise SharedUserError(
            f"run.init_from={run.cfg.run.init_from}: its state does not fit policy.class "
            f"'{run.cfg.classes['policy']}' / algo.class '{run.cfg.classes['algo']}' with this "
            f"config: {' '.join(str(exc).split())[:300]}"
        ) from None


def _say_if_env_state_unsaved(run: Run, runner: EnvRunner | PipelinedEnvRunner) -> None:
    """Once per run (the first rank with envs): a checkpoint cannot hold these envs' state, so a resume begins
    fresh episodes."""
    first = 0 if run.topology.colocated else run.topology.env_ranks[0]
    assert runner.env_backend is not None  # both builders give their runner its backend
    reason = runner.env_backend.unsaved_reason(runner.envs) if run.rank == first else None
    if reason:
        print(f"spmd_rl: note: {reason}", flush=True)
