"""The run as an engine sees it on one rank (`Run`): the plan, this rank's role, builders that hand out role
components ready to use (channels open, state restored from the checkpoint the run resumes from), and the run's
control points (the end-of-iteration agreement, the metrics report). Engines are loops over what it builds.

Every builder keeps one order of the steps that draw random numbers (policy, algorithm, the rank's seed, envs,
then the checkpoint's generators last), which is what makes a resumed run continue exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch

from spmd_rl.comm import sharding
from spmd_rl.comm.channel import local_channel, open_channels
from spmd_rl.comm.weights import GatheredWeightSource, ShardedWeightSource, WeightSync
from spmd_rl.config.sections import Config
from spmd_rl.envs.backend import backend_for
from spmd_rl.envs.vector import EnvSpec, group_of_envs
from spmd_rl.interfaces.algorithm import Algorithm, PolicyMethod
from spmd_rl.interfaces.context import Context
from spmd_rl.interfaces.policy import GROUP, Policy, StepField
from spmd_rl.persist.checkpoint import SHARD_FILES, SHARDS_FROM, restore_rng_state
from spmd_rl.persist.run_control import RunControl, StoppedWithCheckpoint
from spmd_rl.roles.env_runner import EnvRunner
from spmd_rl.roles.inference_server import InferenceParts, InferenceServer, RecurrentStates, UniformActions
from spmd_rl.roles.messages import action_message, observation_message, segment_message, with_episode_starts
from spmd_rl.roles.trainer import Trainer
from spmd_rl.run.evaluation import cuda_indices
from spmd_rl.run.metrics import MetricsLogger
from spmd_rl.run.plan import Plan
from spmd_rl.run.policies import build_policy, read_trained_state
from spmd_rl.run.report import Reporter
from spmd_rl.run.resume import Resume
from spmd_rl.run.state_fit import load_fitted
from spmd_rl.run.topology import COLOCATED, ENV, INFERENCE, TRAINER, ProcessGroups, Topology
from spmd_rl.run.trackers import open_trackers
from spmd_rl.runtime.distributed import Runtime
from spmd_rl.runtime.errors import UserError
from spmd_rl.runtime.watchdog import COLLECTIVE_MARGIN_S, watchdog
from spmd_rl.storage.experience_log import ExperienceLog

# What a resharded resume takes from trainer 0's file (run.resume onto another number of ranks, fsdp only).
RESHARDED_KEYS = ("policy", "algorithm", "metrics", "experience_rows", SHARD_FILES, SHARDS_FROM)
WIRE_DTYPES = {"fp32": None, "bf16": torch.bfloat16}  # inference.dtype: None = the parameters' own
# What Run._weight_sync builds: a member of the weight group that holds buckets, or a trainer's gathering source.
SyncT = TypeVar("SyncT", WeightSync, GatheredWeightSource)


def policy_device(policy: Policy) -> str:
    return next(iter(policy.state_dict().values()), torch.empty(0)).device.type


@dataclass
class Run:
    """Everything an engine needs on one rank, resolved and validated before any process group existed.

    An engine reads `plan`, `role`, `iterations`, `rank`, `cfg` and calls the builders and control points below;
    the other fields are the parts they are built from."""

    cfg: Config
    plan: Plan
    runtime: Runtime
    topology: Topology
    groups: ProcessGroups
    spec: EnvSpec
    outputs: dict[str, StepField]  # the policy's declared per-step outputs
    run_dir: Path
    policy_cls: type[Policy]
    algorithm_cls: type[Algorithm]
    callback_classes: list  # [(class, config)]
    control: RunControl  # the end-of-iteration agreement: checkpoints and stops
    resume: Resume  # where the run starts (a checkpoint every rank loads, or iteration 0)
    final_policy: Policy | None = None  # rank 0's policy, saved as policy.pt at the end or on a stop

    # -- where this rank stands ------------------------------------------------------------------------------------

    @property
    def rank(self) -> int:
        return self.runtime.rank

    @property
    def role(self) -> str:
        """COLOCATED, or in the split layout this rank's role: ENV, INFERENCE or TRAINER."""
        return COLOCATED if self.topology.colocated else self.topology.role_of(self.rank)

    @property
    def iterations(self) -> range:
        """The iterations this rank runs: from the one after the resumed checkpoint to the plan's last."""
        return range(self.resume.start_iteration, self.plan.num_iterations)

    @cached_property
    def recurrent_state(self) -> dict[str, StepField] | None:
        """The policy's declared recurrent state per env (None: stateless), checked by the contract before start.
        Every rank reads it from a policy built the same way, without touching its random streams."""
        with torch.random.fork_rng(devices=[]):
            return build_policy(self.cfg, self.spec, self.policy_cls).recurrent_state()

    def describe(self, rank: int | None = None) -> str:
        """'rank 2 (env 0)': how messages name a rank (this one by default)."""
        return self.topology.describe(self.rank if rank is None else rank)

    # -- control points --------------------------------------------------------------------------------------------

    def end_iteration(self, iteration: int, capture: Callable[[], dict]) -> None:
        """The end-of-iteration agreement of all ranks: a checkpoint (capture() is this rank's part of it) and a
        stop on a signal happen here, at iterations every rank computes alike. Every rank must call it after the
        same iterations."""
        self.control.after_iteration(iteration, capture)

    def verifies(self, version: int) -> bool:
        """Whether weights of this version are checked against trainer 0's checksums (weights.verify_every)."""
        every = self.cfg.weights.verify_every
        return bool(every) and version % every == 0

    def with_metrics(self, run_role: Callable[[MetricsLogger | None], None]) -> Policy | None:
        """Run this rank's role, run_role(logger), with rank 0 logging metrics.jsonl (logger None elsewhere); the
        logger writes its summary only when the role finished. Returns the policy trainer rank 0 saves."""
        logger = None
        if self.rank == 0:
            plan, log = self.plan, self.cfg.log
            logger = MetricsLogger(
                self.run_dir,
                plan.num_iterations * plan.steps_per_iteration,
                log.progress,
                log.interval_s,
                log.tensorboard,
                resumed_env_steps=self.resume.start_iteration * plan.steps_per_iteration,
                trackers=open_trackers(self.cfg, self.run_dir, resumed=self.resume.checkpoint is not None),
                group_names=self.cfg.env.group_names(),
            )
            self.control.mean_return = lambda: logger.last_record.get("episode_return_mean", float("nan"))
        finished = stopped = False
        try:
            run_role(logger)
            finished = True
        except StoppedWithCheckpoint as stop:
            stopped, finished = True, stop.finished  # run.stop_at_return reached: the run is finished
            raise
        finally:
            if logger is not None:
                logger.close(summary=finished, stopped=stopped)
        return self.final_policy

    # -- role components -------------------------------------------------------------------------------------------

    def build_colocated(self, logger: MetricsLogger | None) -> tuple[EnvRunner, InferenceServer, Trainer, Reporter]:
        """The colocated layout: this rank's envs, its own policy copy (the trainer's module is the one that acts)
        and data-parallel learning across ranks, joined by local channels."""
        cfg, plan, rank = self.cfg, self.plan, self.rank
        group = self.groups.trainer if self.runtime.world_size > 1 else None
        with watchdog.watch(f"building policy.class {cfg.classes['policy']}"):
            policy = build_policy(cfg, self.spec, self.policy_cls, self.runtime.device)
        initial_algorithm_state = self._init_policy_from(policy)
        algorithm, callbacks = self._build_algorithm(policy, group)
        with watchdog.watch(f"making and resetting env.id {cfg.env.id}"):
            envs, first_obs = backend_for(cfg.env).make(cfg.env, self.spec, self._seed_rank())
        n, t = cfg.env.num_envs, plan.num_steps
        state = self.recurrent_state
        obs_out, obs_in = local_channel(
            "observations", with_episode_starts(observation_message(self.spec, n), state, n)
        )
        actions_out, actions_in = local_channel("actions", action_message(self.outputs, n, state))
        segments_out, segments_in = local_channel("segments", segment_message(self.spec, self.outputs, t, n, state))
        runner = EnvRunner(
            envs,
            first_obs,
            obs_out,
            actions_in,
            segments_out,
            t,
            list(self.outputs),
            describe=f"rank {rank}",
            env_id=cfg.env.id,
            env_backend=backend_for(cfg.env),
        )
        server = InferenceServer(
            policy,
            [obs_in],
            [actions_out],
            self.runtime.device,
            uniform_actions=self._uniform_actions(),
            states=self._recurrent_states([n]),
        )
        trainer = Trainer(
            algorithm,
            [segments_in],
            [f"rank {rank}"],
            plan.max_env_columns_per_trainer * t,
            group,
            experience_log=self._experience_log(),
            describe=f"rank {rank}",
            timeout=self.runtime.timeout,
            skip_nonfinite_updates=cfg.train.skip_nonfinite_updates,
            policy=policy,
            column_groups=self._column_groups(1),
        )
        report = Reporter(cfg, plan, logger, callbacks, policy)
        self._say_if_env_state_unsaved(runner)
        saved = self._load_checkpoint(trainer_part=True)
        if saved is None:
            self._init_algorithm_from(algorithm, initial_algorithm_state)
        else:
            trainer.load_state_dict(saved)
            report.load_state_dict(saved["metrics"])
            if not self.resume.resharded:  # resharded: fresh episodes and this rank's own fresh streams
                runner.restore(saved)
                server.restore(saved)
                restore_rng_state(saved["rng"])  # last: building the envs above drew from the generators
        if rank == 0:
            self.final_policy = self._final_policy(trainer, policy)
        return runner, server, trainer, report

    def build_env_runner(self, observation_layout=observation_message) -> EnvRunner:
        """A split-layout env rank's runner: its envs, its channels (observations to its inference rank and actions
        back, segments to its trainer). observation_layout(spec, num_envs) lays out the observation message."""
        cfg, topology, spec, rank = self.cfg, self.topology, self.spec, self.rank
        inference, trainer = topology.env_to_inference[rank], topology.env_to_trainer[rank]
        n, t = cfg.env.num_envs, self.plan.num_steps
        state = self.recurrent_state
        with watchdog.watch(f"making and resetting env.id {cfg.env.id}"):
            envs, first_obs = backend_for(cfg.env).make(cfg.env, spec, self._seed_rank())
        (to_inference, to_trainer), (from_inference,) = open_channels(
            me=rank,
            sends=[
                (inference, "observations", with_episode_starts(observation_layout(spec, n), state, n)),
                (trainer, "segments", segment_message(spec, self.outputs, t, n, state)),
            ],
            recvs=[(inference, "actions", action_message(self.outputs, n, state))],
            describe_rank=topology.describe,
            timeout=self.runtime.timeout,
        )
        runner = EnvRunner(
            envs,
            first_obs,
            to_inference,
            from_inference,
            to_trainer,
            t,
            list(self.outputs),
            describe=self.describe(),
            env_id=cfg.env.id,
            env_backend=backend_for(cfg.env),
        )
        self._say_if_env_state_unsaved(runner)
        saved = self._load_checkpoint()
        if saved is not None:
            runner.restore(saved)
            restore_rng_state(saved["rng"])
        return runner

    def build_inference_server(self) -> InferenceServer:
        """A split-layout inference rank's server for the sync engine (fixed order, one forward pass a step)."""
        parts = self.inference_parts()
        return InferenceServer(
            parts.policy,
            parts.obs_channels,
            parts.action_channels,
            self.runtime.device,
            parts.weight_sync,
            uniform_actions=parts.uniform_actions,
            states=parts.states,
        )

    def inference_parts(self, observation_layout=observation_message, recv_buffers: int = 1) -> InferenceParts:
        """An inference rank's policy (its weights come from trainer 0), weight sync and channels to and from its
        env ranks, for an engine that serves in its own way."""
        cfg, topology, rank = self.cfg, self.topology, self.rank
        served = topology.envs_served_by(rank)
        n = cfg.env.num_envs
        state_fields = self.recurrent_state
        with watchdog.watch(f"building policy.class {cfg.classes['policy']}"):
            policy = build_policy(cfg, self.spec, self.policy_cls, self.runtime.device)
        if cfg.inference.dtype == "bf16":  # this rank's copy (and the wire) in bf16; it acts under autocast
            sharding.compute_in_bf16(sharding.cast_parameters(policy, torch.bfloat16), ["act"], policy_device(policy))
        weight_sync = self._weight_sync(policy, WeightSync, **self._sender_options())
        self._seed_rank()
        observations = [with_episode_starts(observation_layout(self.spec, n), state_fields, n) for _ in served]
        action_channels, obs_channels = open_channels(
            me=rank,
            sends=[(env, "actions", action_message(self.outputs, n, state_fields)) for env in served],
            recvs=[(env, "observations", layout) for env, layout in zip(served, observations)],
            describe_rank=topology.describe,
            timeout=self.runtime.timeout,
            num_recv_buffers=recv_buffers,
        )
        states = self._recurrent_states([n] * len(served))
        state = self._load_checkpoint()
        if state is not None:
            if states is not None:
                states.load_state_dict(state["recurrent_state"])
            restore_rng_state(state["rng"])  # the weights come from trainer 0
        return InferenceParts(policy, weight_sync, obs_channels, action_channels, self._uniform_actions(), states)

    def build_trainer(self, logger: MetricsLogger | None, recv_buffers: int = 1) -> tuple[Trainer, Reporter]:
        """A split-layout trainer rank's trainer (trainer 0's also publishes weights) and its report.
        recv_buffers: segment receives an engine may keep posted per env rank."""
        cfg, plan, topology, rank = self.cfg, self.plan, self.topology, self.rank
        sources = topology.envs_trained_by(rank)
        n, t = cfg.env.num_envs, plan.num_steps
        group = self.groups.trainer if len(topology.trainer_ranks) > 1 else None
        with watchdog.watch(f"building policy.class {cfg.classes['policy']}"):
            policy = build_policy(cfg, self.spec, self.policy_cls, self.runtime.device)
        initial_algorithm_state = self._init_policy_from(policy)
        weight_sync: WeightSync | GatheredWeightSource | None
        if self._gathers_weights:  # after sharding: every trainer gathers its shards for trainer 0's broadcast
            algorithm, callbacks = self._build_algorithm(policy, group)
            weight_sync = self._gathered_weight_source(policy)
        else:  # before the optimizer and DDP: it points the parameters into its flat buckets
            weight_sync = self._weight_sync(policy, WeightSync) if rank == topology.trainer_ranks[0] else None
            algorithm, callbacks = self._build_algorithm(policy, group)
        self._seed_rank()
        _, segment_channels = open_channels(
            me=rank,
            sends=[],
            recvs=[
                (env, "segments", segment_message(self.spec, self.outputs, t, n, self.recurrent_state))
                for env in sources
            ],
            describe_rank=topology.describe,
            timeout=self.runtime.timeout,
            num_recv_buffers=recv_buffers,
        )
        trainer = Trainer(
            algorithm,
            segment_channels,
            [topology.describe(e) for e in sources],
            plan.max_env_columns_per_trainer * t,
            group,
            weight_sync,
            self._experience_log(),
            describe=self.describe(),
            timeout=self.runtime.timeout,
            skip_nonfinite_updates=cfg.train.skip_nonfinite_updates,
            policy=policy,
            column_groups=self._column_groups(len(sources)),
        )
        report = Reporter(cfg, plan, logger, callbacks, policy)
        state = self._load_checkpoint(trainer_part=True)
        if state is None:
            self._init_algorithm_from(algorithm, initial_algorithm_state)
        else:
            trainer.load_state_dict(state)
            report.load_state_dict(state["metrics"])
            if not self.resume.resharded:
                restore_rng_state(state["rng"])
        if rank == 0:
            self.final_policy = self._final_policy(trainer, policy)
        return trainer, report

    # -- the parts the builders share ------------------------------------------------------------------------------

    def _seed_rank(self) -> int:
        # Distinct, reproducible streams per rank: each rank's envs get seeds seed*1000003 + rank*num_envs + i.
        cfg = self.cfg
        torch.manual_seed(cfg.train.seed * 1_000_003 + self.rank)
        return cfg.train.seed * 1_000_003 + self.rank * cfg.env.num_envs

    def _load_checkpoint(self, trainer_part: bool = False) -> dict | None:
        """This rank's state in the checkpoint the run resumes from, or None for a fresh start. Always on the CPU:
        generators, env state and samplers are restored from CPU tensors; weights and optimizer state move to their
        device as they are loaded into their modules."""
        if self.resume.checkpoint is None:
            return None
        if self.resume.resharded:
            # Saved by another number of ranks (train.parallel=fsdp): trainers take the model and optimizer from
            # the shard files (resharded) and the rest of the learner's state from trainer 0's file, which all
            # trainers shared; env and inference ranks start fresh.
            if not trainer_part:
                return None
            state = self.control.store.load(self.resume.checkpoint, 0, map_location="cpu")
            return {key: state[key] for key in RESHARDED_KEYS if key in state}
        return self.control.store.load(self.resume.checkpoint, self.rank, map_location="cpu")

    def _context(self, group) -> Context:
        topology = self.topology
        trainers = topology.trainer_ranks if not topology.colocated else list(range(self.runtime.world_size))
        return Context(
            rank=self.rank,
            trainer_index=trainers.index(self.rank),
            num_trainers=len(trainers),
            group=group,
            device=self.runtime.device,
            timeout=self.runtime.timeout,
            run_dir=self.run_dir,
            seed=self.cfg.train.seed,
            num_iterations=self.plan.num_iterations,
            steps_per_iteration=self.plan.steps_per_iteration,
            observation_space=self.spec.observation_space,
            action_space=self.spec.action_space,
            buffer=self.cfg.buffer,
            parallel=self.cfg.train.parallel,
            precision=self.cfg.train.precision,
            activation_checkpointing=self.cfg.train.activation_checkpointing,
            policy_methods=(
                "act",
                *(m.name if isinstance(m, PolicyMethod) else m for m in self.algorithm_cls.policy_methods),
            ),
            hybrid_shards=(
                (self.groups.replicate, self.groups.shard, self.groups.shard_mesh) if self.groups.shard_mesh else None
            ),
        )

    def _build_algorithm(self, policy: Policy, group) -> tuple[Algorithm, list]:
        context = self._context(group)
        with watchdog.watch(f"building algo.class {self.cfg.classes['algo']} and the callbacks", COLLECTIVE_MARGIN_S):
            algorithm = self.algorithm_cls(policy, self.cfg.algo, context)
            callbacks = [cls(config, context) for cls, config in self.callback_classes]
        return algorithm, callbacks

    def _final_policy(self, trainer: Trainer, policy: Policy) -> Policy:
        """What rank 0 saves as policy.pt: the policy itself, or with sharded trainers a plain copy on the CPU that
        every checkpoint fills with the gathered full weights."""
        if not trainer.sharded:
            return policy
        with torch.random.fork_rng(devices=cuda_indices(self.runtime.device)):  # build_policy seeds torch
            trainer.final_copy = build_policy(self.cfg, self.spec, self.policy_cls, "cpu")
        return trainer.final_copy

    @property
    def _gathers_weights(self) -> bool:
        """Whether trainers publish through a GatheredWeightSource: their parameters are shards, or the wire
        carries another dtype than theirs (otherwise trainer 0's own tensors are the buckets)."""
        return self.cfg.train.parallel == "fsdp" or self.cfg.inference.dtype != "fp32"

    def _gathered_weight_source(self, policy: Policy) -> GatheredWeightSource:
        """Sharded trainers each send their own shards (ShardedWeightSource); replicated ones with another wire
        dtype fill one bucket at a time for trainer 0's broadcast (GatheredWeightSource)."""
        wire_dtype = WIRE_DTYPES[self.cfg.inference.dtype]
        if self.groups.sender_ranks:
            return self._weight_sync(
                policy,
                ShardedWeightSource,
                wire_dtype=wire_dtype,
                receivers=list(self.topology.inference_ranks),
                **self._sender_options(),
            )
        return self._weight_sync(policy, GatheredWeightSource, wire_dtype=wire_dtype)

    def _sender_options(self) -> dict:
        """With sharded trainers: who sends the pieces of every bucket (for both ends of a sync)."""
        if not self.groups.sender_ranks:
            return {}
        return {"senders": list(self.groups.sender_ranks), "sender_group": self.groups.weight_senders}

    def _weight_sync(self, policy: Policy, kind: type[SyncT], **options) -> SyncT:
        """This rank's member of the weight group (kind: WeightSync, or a trainer's GatheredWeightSource)."""
        topology, runtime = self.topology, self.runtime
        return kind(
            policy,
            self.groups.weights,
            src=topology.trainer_ranks[0],
            me=runtime.rank,
            bucket_bytes=int(self.cfg.weights.bucket_mb * 2**20),
            timeout=runtime.timeout,
            describe_rank=topology.describe,
            **options,
        )

    def _recurrent_states(self, counts: list[int]) -> RecurrentStates | None:
        """Where an inference server keeps a recurrent policy's state: one row per env it acts for."""
        fields = self.recurrent_state
        return None if fields is None else RecurrentStates(fields, counts, self.runtime.device)

    def _column_groups(self, env_ranks: int) -> torch.Tensor | None:
        """With env groups, the group of every env column a trainer receives from `env_ranks` env ranks (each
        rank's envs are the groups' envs in order); None without groups."""
        if not self.cfg.env.groups:
            return None
        return torch.from_numpy(np.tile(group_of_envs(self.cfg.env), env_ranks))

    def _uniform_actions(self) -> UniformActions | None:
        return UniformActions(self.spec.action_space, self.outputs) if self.plan.explore_iterations else None

    def _experience_log(self) -> ExperienceLog | None:
        buffer = self.cfg.buffer
        if not buffer.log_experience:
            return None
        example = segment_message(
            self.spec, self.outputs, self.plan.num_steps, self.cfg.env.num_envs, self.recurrent_state
        )["rollout"]
        groups = self.cfg.env.group_names()
        if groups:  # the column Trainer.learn adds to what it logs
            example[GROUP] = torch.zeros(example.batch_size, dtype=torch.int16)
        return ExperienceLog(
            self.run_dir,
            self.rank,
            example,
            chunk_rows=buffer.chunk_rows,
            compression=buffer.h5_compression,
            flush_every_s=buffer.flush_every_s,
            group_names=groups,
            must_exist=self.resume.checkpoint is not None,
        )

    def _init_policy_from(self, policy: Policy) -> dict | None:
        """run.init_from: a new run starts from trained or pretrained weights, loaded into the policy as it is built
        (before DDP or sharding wraps it); returns the algorithm's state for _init_algorithm_from when
        run.init_algorithm asks for it. Nothing when the run resumes: the checkpoint has the weights."""
        run = self.cfg.run
        if not run.init_from:
            if run.init_prefix:
                raise UserError(f"run.init_prefix={run.init_prefix} needs run.init_from (the file to load)")
            return None
        if run.init_prefix and run.init_algorithm:
            raise UserError(
                "run.init_prefix loads a part of the policy, and run.init_algorithm=true the algorithm's state "
                "for the whole of it: use one of them"
            )
        if run.init_algorithm and self.cfg.train.parallel == "fsdp":
            raise UserError(
                "run.init_algorithm=true with train.parallel=fsdp is not supported (the optimizer state would have "
                "to be resharded from a whole copy); start from the weights only, or resume the run instead"
            )
        if self.resume.checkpoint is not None:
            return None
        policy_state, algorithm_state = read_trained_state(run.init_from, with_algorithm=run.init_algorithm)
        try:
            load_fitted(policy, policy_state, run.init_prefix)
        except UserError as exc:
            raise UserError(
                f"run.init_from={run.init_from}: its weights do not fit policy.class "
                f"'{self.cfg.classes['policy']}': {exc}"
            ) from None
        return algorithm_state

    def _init_algorithm_from(self, algorithm: Algorithm, state: dict | None) -> None:
        """run.init_algorithm: the algorithm's state from run.init_from's checkpoint (a fresh run only)."""
        if state is None:
            return
        if any(sharding.is_dtensor(p) for p in algorithm.policy.parameters()):
            raise UserError(
                "run.init_algorithm=true with train.parallel=fsdp is not supported (the optimizer state would have "
                "to be resharded from a whole copy); start from the weights only, or resume the run instead"
            )
        try:
            algorithm.load_state_dict(state)
        except (RuntimeError, KeyError, ValueError) as exc:
            raise UserError(
                f"run.init_from={self.cfg.run.init_from}: its state does not fit policy.class "
                f"'{self.cfg.classes['policy']}' / algo.class '{self.cfg.classes['algo']}' with this "
                f"config: {' '.join(str(exc).split())[:300]}"
            ) from None

    def _say_if_env_state_unsaved(self, runner: EnvRunner) -> None:
        """Once per run (the first rank with envs): a checkpoint cannot hold these envs' state, so a resume begins
        fresh episodes."""
        first = 0 if self.topology.colocated else self.topology.env_ranks[0]
        backend = runner.env_backend
        assert backend is not None  # the run gives every runner its env backend
        reason = backend.unsaved_reason(runner.envs) if self.rank == first else None
        if reason:
            print(f"spmd_rl: note: {reason}", flush=True)


__all__ = ["COLOCATED", "ENV", "INFERENCE", "TRAINER", "Run"]
