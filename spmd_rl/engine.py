"""The sync engine: one iteration is collect -> transfer -> learn -> broadcast weights -> next.

The plan (iterations, batch sizes, when weights move, when actions are random) is derived from the config and the
topology alone, so every rank knows its whole schedule before the first message. Each rank then runs the story of
its role: in the colocated layout all three roles take turns in one process through local channels; in the split
layout each rank runs one role's loop.
"""

from __future__ import annotations

import datetime
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from spmd_rl.comm.channel import local_channel, open_channels
from spmd_rl.comm.weights import WeightSync
from spmd_rl.config import Config
from spmd_rl.envs import EnvSpec, make_vector_env
from spmd_rl.errors import UserError
from spmd_rl.metrics import MetricsLogger
from spmd_rl.roles.env_worker import EnvWorker, run_env_rank
from spmd_rl.roles.inference_server import InferenceServer, run_inference_rank
from spmd_rl.roles.learners import PPOLearner, SACLearner, transitions_of
from spmd_rl.roles.messages import action_message, observation_message, segment_message
from spmd_rl.roles.trainer import Trainer, run_trainer_rank
from spmd_rl.runtime import Runtime
from spmd_rl.topology import ENV, INFERENCE, ProcessGroups, Topology


@dataclass(frozen=True)
class Plan:
    algo: str
    env_ranks: int
    trainer_ranks: int
    envs_total: int
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

    def describe(self, cfg: Config, world_size: int, layout: str) -> str:
        text = (f"{self.algo} on {cfg.env.id}; world size {world_size}, layout {layout}; {self.env_ranks} env "
                f"rank(s) x {cfg.env.num_envs} envs = {self.envs_total} envs; {self.steps_per_iteration} env steps "
                f"per iteration ({cfg.algo.num_steps} steps x {self.envs_total} envs); {self.trainer_ranks} trainer "
                f"rank(s); {self.num_iterations} iterations = {self.num_iterations * self.steps_per_iteration} "
                f"env steps; ")
        if self.algo == "ppo":
            per_trainer = self.steps_per_iteration // self.trainer_ranks
            return text + (f"batch {self.steps_per_iteration} ({per_trainer} per trainer), "
                           f"{cfg.algo.num_minibatches} minibatch(es) of {per_trainer // cfg.algo.num_minibatches} "
                           f"per trainer, {cfg.algo.update_epochs} epochs")
        return text + (f"replay batch {cfg.sac.batch_size} (all trainers), {cfg.sac.updates_per_step:g} updates "
                       f"per env step after {cfg.sac.learning_starts} random steps" +
                       (f", weights broadcast every {self.sync_every} iteration(s)" if layout.startswith("split")
                        else ""))


def plan_run(cfg: Config, topology: Topology) -> Plan:
    env_ranks = len(topology.env_ranks)
    envs_total = env_ranks * cfg.env.num_envs
    steps_per_iteration = envs_total * cfg.algo.num_steps
    num_iterations = cfg.train.total_steps // steps_per_iteration
    if num_iterations < 1:
        raise UserError(f"train.total_steps={cfg.train.total_steps} is less than one iteration "
                        f"({steps_per_iteration} env steps = algo.num_steps x env.num_envs x {env_ranks} env ranks); "
                        f"raise train.total_steps to at least {steps_per_iteration}")
    env_ranks_per_trainer = [len(topology.envs_trained_by(t)) for t in topology.trainer_ranks]
    if len(set(env_ranks_per_trainer)) > 1:
        # DDP (and SAC's gradient averaging) weighs every trainer equally: unequal shares would overweight the
        # samples of the trainers with fewer env ranks.
        raise UserError(f"layout.env={len(topology.env_ranks)} env ranks cannot be shared equally by "
                        f"layout.trainer={len(topology.trainer_ranks)} trainers; make layout.env a multiple of "
                        f"layout.trainer")
    if cfg.algo.name == "sac" and cfg.sac.batch_size % len(topology.trainer_ranks):
        raise UserError(f"sac.batch_size={cfg.sac.batch_size} must be a multiple of the {len(topology.trainer_ranks)} "
                        f"trainer ranks (each samples an equal share of every batch)")
    fewest_samples = min(env_ranks_per_trainer) * cfg.env.num_envs * cfg.algo.num_steps
    if cfg.algo.name == "ppo" and fewest_samples < cfg.algo.num_minibatches:
        raise UserError(f"algo.num_minibatches={cfg.algo.num_minibatches} is more than the {fewest_samples} samples "
                        f"a trainer holds per iteration; lower it")
    sac = cfg.algo.name == "sac"
    return Plan(
        algo=cfg.algo.name,
        env_ranks=env_ranks,
        trainer_ranks=len(topology.trainer_ranks),
        envs_total=envs_total,
        steps_per_iteration=steps_per_iteration,
        num_iterations=num_iterations,
        max_env_columns_per_trainer=max(env_ranks_per_trainer) * cfg.env.num_envs,
        sync_every=cfg.sac.weight_sync_every if sac else 1,
        explore_iterations=math.ceil(cfg.sac.learning_starts / steps_per_iteration) if sac else 0,
    )


def make_policy(cfg: Config, spec: EnvSpec, device: torch.device | str = "cpu") -> torch.nn.Module:
    """The module inference ranks act with and trainer rank 0 broadcasts. Unsupported spaces are a UserError."""
    torch.manual_seed(cfg.train.seed)  # the same initial module everywhere; trainer 0's is the one that counts
    if cfg.algo.name == "sac":
        from spmd_rl.modules.sac_networks import SquashedGaussianActor
        return SquashedGaussianActor(spec.observation_space, spec.action_space, cfg.model).to(device)
    from spmd_rl.modules.actor_critic import ActorCritic
    return ActorCritic(spec.observation_space, spec.action_space, cfg.model).to(device)


def make_learner(cfg: Config, plan: Plan, spec: EnvSpec, policy, group, rank: int, run_dir: Path,
                 device: torch.device):
    """The algorithm's learner for one trainer. group: the trainer group, or None for a single trainer."""
    timeout = datetime.timedelta(seconds=cfg.dist.timeout_s)
    if cfg.algo.name == "ppo":
        from spmd_rl.algorithms.ppo import PPO
        ddp = None
        if group is not None:
            # Gradients are averaged over the trainer group: each trainer's minibatch is a slice of a global one.
            # Buffers (normalizer statistics) are merged by their own all-reduce, so DDP need not sync them on
            # every forward.
            ddp = DistributedDataParallel(policy, process_group=group, forward_sync_buffers=False)
        ppo = PPO(policy, ddp, cfg.algo, plan.num_iterations, group=group, timeout=timeout)
        return PPOLearner(policy, ppo, group, device)

    from spmd_rl.algorithms.sac import SAC
    from spmd_rl.storage.replay import ReplayBuffer, ShardedReplay
    sac = SAC(policy, spec.observation_space, spec.action_space, cfg.model, cfg.sac, group=group, timeout=timeout)
    if group is not None:
        sac.sync_from(dist.get_process_group_ranks(group)[0])
    example = transitions_of(segment_message(spec, cfg.algo.num_steps, 1))
    shard = ReplayBuffer(cfg.buffer.capacity, example, backend=cfg.buffer.backend,
                         path=run_dir / "buffer" / f"replay_rank{rank}.h5", chunk_rows=cfg.buffer.chunk_rows,
                         compression=cfg.buffer.h5_compression)
    replay = ShardedReplay(shard, group, timeout, seed=cfg.train.seed) if group is not None else LocalReplay(shard)
    return SACLearner(sac, replay, cfg.sac.batch_size, cfg.sac.updates_per_step, cfg.sac.learning_starts,
                      plan.steps_per_iteration, device)


class LocalReplay:
    """A single trainer's replay: its shard is the whole buffer."""

    def __init__(self, shard):
        self.shard = shard

    def sample(self, batch_size: int):
        return self.shard.sample(batch_size)


def make_experience_log(cfg: Config, spec: EnvSpec, rank: int, run_dir: Path):
    if not cfg.buffer.log_experience:
        return None
    from spmd_rl.storage.hdf5 import ExperienceLog
    example = segment_message(spec, cfg.algo.num_steps, cfg.env.num_envs)["rollout"]
    return ExperienceLog(run_dir, rank, example, chunk_rows=cfg.buffer.chunk_rows,
                         compression=cfg.buffer.h5_compression)


class Reporter:
    """Called after every iteration on every trainer; only the first trainer (global rank 0) logs."""

    def __init__(self, plan: Plan, logger: MetricsLogger | None):
        self.plan = plan
        self.logger = logger

    def __call__(self, iteration: int, losses: dict, statistics: dict | None, trainer: Trainer) -> None:
        if self.logger is None or statistics is None:
            return
        times = {"time_learn_s": trainer.learn_s, "time_weight_sync_s": trainer.weight_sync_s}
        self.logger.log(iteration, (iteration + 1) * self.plan.steps_per_iteration, losses, statistics, times)


def run(cfg: Config, plan: Plan, runtime: Runtime, topology: Topology, groups: ProcessGroups, spec: EnvSpec,
        run_dir: Path) -> None:
    rank = runtime.rank
    logger = None
    if rank == 0:
        logger = MetricsLogger(run_dir, plan.num_iterations * plan.steps_per_iteration, cfg.log.progress,
                               cfg.log.interval_s, cfg.log.tensorboard)
    finished = False
    try:
        if topology.colocated:
            policy = _run_colocated(cfg, plan, runtime, groups, spec, run_dir, Reporter(plan, logger))
        elif topology.role_of(rank) == ENV:
            policy = _run_env(cfg, plan, runtime, topology, spec)
        elif topology.role_of(rank) == INFERENCE:
            policy = _run_inference(cfg, plan, runtime, topology, groups, spec)
        else:
            policy = _run_trainer(cfg, plan, runtime, topology, groups, spec, run_dir, Reporter(plan, logger))
        finished = True
    finally:
        if logger is not None:
            logger.close(summary=finished)
    if rank == 0:
        # Clones: with a weight sync, tensors of several dtypes are views of one byte bucket, which torch.save
        # refuses; the file should hold plain tensors anyway.
        torch.save({k: v.detach().clone() for k, v in policy.state_dict().items()}, run_dir / "policy.pt")


def _seed_rank(cfg: Config, rank: int) -> int:
    # Distinct, reproducible streams per rank: each rank's envs get seeds seed*1000003 + rank*num_envs + i.
    torch.manual_seed(cfg.train.seed * 1_000_003 + rank)
    return cfg.train.seed * 1_000_003 + rank * cfg.env.num_envs


def _run_colocated(cfg, plan: Plan, runtime, groups, spec, run_dir, report) -> torch.nn.Module:
    """Every rank: its own envs, its own policy copy, data-parallel learning across ranks. The roles take turns
    in this process, through local channels."""
    device, rank = runtime.device, runtime.rank
    group = groups.trainer if runtime.world_size > 1 else None
    policy = make_policy(cfg, spec, device)
    learner = make_learner(cfg, plan, spec, policy, group, rank, run_dir, device)
    envs, first_obs = make_vector_env(cfg.env, spec, _seed_rank(cfg, rank))
    n, t = cfg.env.num_envs, cfg.algo.num_steps
    obs_out, obs_in = local_channel("observations", observation_message(spec, n))
    actions_out, actions_in = local_channel("actions", action_message(spec, n))
    segments_out, segments_in = local_channel("segments", segment_message(spec, t, n))
    worker = EnvWorker(envs, first_obs, obs_out, actions_in, segments_out, t)
    server = InferenceServer(policy, [obs_in], [actions_out], device, action_space=spec.action_space)
    trainer = Trainer(learner, [segments_in], [f"rank {rank}"], plan.max_env_columns_per_trainer * t, group,
                      experience_log=make_experience_log(cfg, spec, rank, run_dir), describe=f"rank {rank}")
    for iteration in range(plan.num_iterations):
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
    worker.close()
    trainer.close()
    return policy


def _run_env(cfg, plan: Plan, runtime, topology: Topology, spec) -> None:
    rank = runtime.rank
    inference, trainer = topology.env_to_inference[rank], topology.env_to_trainer[rank]
    n, t = cfg.env.num_envs, cfg.algo.num_steps
    envs, first_obs = make_vector_env(cfg.env, spec, _seed_rank(cfg, rank))
    (to_inference, to_trainer), (from_inference,) = open_channels(
        me=rank,
        sends=[(inference, "observations", observation_message(spec, n)),
               (trainer, "segments", segment_message(spec, t, n))],
        recvs=[(inference, "actions", action_message(spec, n))],
        describe_rank=topology.describe, timeout=runtime.timeout)
    worker = EnvWorker(envs, first_obs, to_inference, from_inference, to_trainer, t)
    run_env_rank(worker, plan.num_iterations)
    return None


def _weight_sync(cfg, runtime, topology: Topology, groups, policy) -> WeightSync:
    return WeightSync(policy, groups.weights, src=topology.trainer_ranks[0], me=runtime.rank,
                      bucket_bytes=int(cfg.weights.bucket_mb * 2**20), timeout=runtime.timeout,
                      describe_rank=topology.describe)


def _run_inference(cfg, plan: Plan, runtime, topology: Topology, groups, spec) -> torch.nn.Module:
    rank = runtime.rank
    served = topology.envs_served_by(rank)
    n = cfg.env.num_envs
    policy = make_policy(cfg, spec, runtime.device)
    weight_sync = _weight_sync(cfg, runtime, topology, groups, policy)
    _seed_rank(cfg, rank)
    action_channels, obs_channels = open_channels(
        me=rank,
        sends=[(env, "actions", action_message(spec, n)) for env in served],
        recvs=[(env, "observations", observation_message(spec, n)) for env in served],
        describe_rank=topology.describe, timeout=runtime.timeout)
    server = InferenceServer(policy, obs_channels, action_channels, runtime.device, weight_sync, spec.action_space)
    run_inference_rank(server, plan, cfg.algo.num_steps, cfg.weights.verify_every)
    return policy


def _run_trainer(cfg, plan: Plan, runtime, topology: Topology, groups, spec, run_dir, report) -> torch.nn.Module:
    rank = runtime.rank
    sources = topology.envs_trained_by(rank)
    n, t = cfg.env.num_envs, cfg.algo.num_steps
    group = groups.trainer if len(topology.trainer_ranks) > 1 else None
    policy = make_policy(cfg, spec, runtime.device)
    # Built before the optimizer and DDP: it points the parameters into its flat buckets.
    weight_sync = _weight_sync(cfg, runtime, topology, groups, policy) if rank == topology.trainer_ranks[0] else None
    learner = make_learner(cfg, plan, spec, policy, group, rank, run_dir, runtime.device)
    _seed_rank(cfg, rank)
    _, segment_channels = open_channels(
        me=rank, sends=[],
        recvs=[(env, "segments", segment_message(spec, t, n)) for env in sources],
        describe_rank=topology.describe, timeout=runtime.timeout)
    trainer = Trainer(learner, segment_channels, [topology.describe(e) for e in sources],
                      plan.max_env_columns_per_trainer * t, group, weight_sync,
                      make_experience_log(cfg, spec, rank, run_dir), describe=topology.describe(rank))
    run_trainer_rank(trainer, plan, cfg.weights.verify_every, report)
    trainer.close()
    return policy
