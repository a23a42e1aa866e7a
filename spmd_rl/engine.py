"""The sync engine: one iteration is collect -> transfer -> learn -> broadcast weights -> next.

The plan (iterations, batch sizes) is derived from the config and the topology alone, so every rank knows its
whole schedule before the first message. Each rank then runs the story of its role: in the colocated layout all
three roles take turns in one process through local channels; in the split layout each rank runs one role's loop.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel

from spmd_rl.algorithms.ppo import PPO
from spmd_rl.comm.channel import local_channel, open_channels
from spmd_rl.comm.weights import WeightSync
from spmd_rl.config import Config
from spmd_rl.envs import EnvSpec, make_vector_env
from spmd_rl.errors import UserError
from spmd_rl.metrics import MetricsLogger
from spmd_rl.modules.actor_critic import ActorCritic
from spmd_rl.roles.env_worker import EnvWorker, run_env_rank
from spmd_rl.roles.inference_server import InferenceServer, run_inference_rank
from spmd_rl.roles.messages import action_message, observation_message, segment_message
from spmd_rl.roles.trainer import Trainer, run_trainer_rank
from spmd_rl.runtime import Runtime
from spmd_rl.topology import ENV, INFERENCE, ProcessGroups, Topology


@dataclass(frozen=True)
class Plan:
    env_ranks: int
    trainer_ranks: int
    envs_total: int
    steps_per_iteration: int          # env steps per iteration, all env ranks together
    num_iterations: int
    minibatch_size: int               # global: all trainers together
    max_env_columns_per_trainer: int  # env columns of the busiest trainer

    def describe(self, cfg: Config, world_size: int, layout: str) -> str:
        return (f"world size {world_size}, layout {layout}; {self.env_ranks} env rank(s) x {cfg.env.num_envs} envs "
                f"= {self.envs_total} envs; batch {self.steps_per_iteration} env steps per iteration "
                f"({cfg.algo.num_steps} steps x {self.envs_total} envs), {self.trainer_ranks} trainer rank(s), "
                f"{self.num_iterations} iterations = {self.num_iterations * self.steps_per_iteration} env steps; "
                f"minibatch {self.minibatch_size} ({cfg.algo.num_minibatches} per epoch, "
                f"{cfg.algo.update_epochs} epochs)")


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
    columns = max(env_ranks_per_trainer) * cfg.env.num_envs
    per_trainer_min = min(env_ranks_per_trainer) * cfg.env.num_envs
    if per_trainer_min * cfg.algo.num_steps < cfg.algo.num_minibatches:
        raise UserError(f"algo.num_minibatches={cfg.algo.num_minibatches} is more than the "
                        f"{per_trainer_min * cfg.algo.num_steps} samples a trainer holds per iteration; lower it")
    return Plan(env_ranks, len(topology.trainer_ranks), envs_total, steps_per_iteration, num_iterations,
                steps_per_iteration // cfg.algo.num_minibatches, columns)


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
    torch.manual_seed(cfg.train.seed)
    logger = None
    if rank == 0:
        logger = MetricsLogger(run_dir, plan.num_iterations * plan.steps_per_iteration, cfg.log.progress,
                               cfg.log.interval_s, cfg.log.tensorboard)
    try:
        if topology.colocated:
            policy = _run_colocated(cfg, plan, runtime, groups, spec, Reporter(plan, logger))
        elif topology.role_of(rank) == ENV:
            policy = _run_env(cfg, plan, runtime, topology, spec)
        elif topology.role_of(rank) == INFERENCE:
            policy = _run_inference(cfg, plan, runtime, topology, groups, spec)
        else:
            policy = _run_trainer(cfg, plan, runtime, topology, groups, spec, Reporter(plan, logger))
    finally:
        if logger is not None:
            logger.close()
    if rank == 0:
        # Clones: with a weight sync, tensors of several dtypes are views of one byte bucket, which torch.save
        # refuses; the file should hold plain tensors anyway.
        torch.save({k: v.detach().clone() for k, v in policy.state_dict().items()}, run_dir / "policy.pt")


def _seed_rank(cfg: Config, rank: int) -> int:
    # Distinct, reproducible streams per rank: each rank's envs get seeds seed*1000003 + rank*num_envs + i.
    torch.manual_seed(cfg.train.seed * 1_000_003 + rank)
    return cfg.train.seed * 1_000_003 + rank * cfg.env.num_envs


def _make_policy(cfg: Config, spec: EnvSpec, device: torch.device) -> ActorCritic:
    torch.manual_seed(cfg.train.seed)
    return ActorCritic(spec.observation_space, spec.action_space, cfg.model).to(device)


def _make_ppo(cfg: Config, plan: Plan, policy: ActorCritic, group, distributed: bool) -> PPO:
    ddp = None
    if distributed:
        # Gradients are averaged over the trainer group, so each trainer's minibatch is a slice of a global one.
        ddp = DistributedDataParallel(policy, process_group=group, broadcast_buffers=False)
    return PPO(policy, ddp, cfg.algo, plan.num_iterations, group=group if distributed else None,
               timeout=datetime.timedelta(seconds=cfg.dist.timeout_s))


def _run_colocated(cfg, plan, runtime, groups, spec, report) -> ActorCritic:
    """Every rank: its own envs, its own policy copy, DDP across ranks. The roles take turns in this process."""
    device = runtime.device
    policy = _make_policy(cfg, spec, device)
    ppo = _make_ppo(cfg, plan, policy, groups.trainer, runtime.world_size > 1)
    envs, first_obs = make_vector_env(cfg.env, _seed_rank(cfg, runtime.rank))
    n, t = cfg.env.num_envs, cfg.algo.num_steps
    obs_out, obs_in = local_channel("observations", observation_message(spec, n))
    actions_out, actions_in = local_channel("actions", action_message(spec, n))
    segments_out, segments_in = local_channel("segments", segment_message(spec, t, n))
    worker = EnvWorker(envs, first_obs, obs_out, actions_in, segments_out, t)
    server = InferenceServer(policy, [obs_in], [actions_out], device)
    trainer = Trainer(policy, ppo, [segments_in], [f"rank {runtime.rank}"], plan.max_env_columns_per_trainer * t,
                      device, groups.trainer if runtime.world_size > 1 else None, describe=f"rank {runtime.rank}")
    for iteration in range(plan.num_iterations):
        server.policy_version = iteration  # the module is shared: every step acts with the current weights
        for step in range(t):
            worker.send_observations(step)
            server.serve_step()
            worker.receive_actions_and_step(step)
        worker.send_segment()
        segment = trainer.receive_segments(expected_version=iteration)
        losses = trainer.learn(segment, iteration)
        report(iteration, losses, trainer.gather_statistics(segment), trainer)
    worker.close()
    return policy


def _run_env(cfg, plan, runtime, topology: Topology, spec) -> None:
    rank = runtime.rank
    inference, trainer = topology.env_to_inference[rank], topology.env_to_trainer[rank]
    n, t = cfg.env.num_envs, cfg.algo.num_steps
    envs, first_obs = make_vector_env(cfg.env, _seed_rank(cfg, rank))
    (to_inference, to_trainer), (from_inference,) = open_channels(
        me=rank,
        sends=[(inference, "observations", observation_message(spec, n)),
               (trainer, "segments", segment_message(spec, t, n))],
        recvs=[(inference, "actions", action_message(spec, n))],
        describe_rank=topology.describe, timeout=runtime.timeout)
    worker = EnvWorker(envs, first_obs, to_inference, from_inference, to_trainer, t)
    run_env_rank(worker, plan.num_iterations)
    return None


def _run_inference(cfg, plan, runtime, topology: Topology, groups, spec) -> ActorCritic:
    rank = runtime.rank
    _seed_rank(cfg, rank)
    served = topology.envs_served_by(rank)
    n = cfg.env.num_envs
    policy = _make_policy(cfg, spec, runtime.device)
    weight_sync = WeightSync(policy, groups.weights, src=topology.trainer_ranks[0], me=rank,
                             bucket_bytes=int(cfg.weights.bucket_mb * 2**20), timeout=runtime.timeout,
                             describe_rank=topology.describe)
    action_channels, obs_channels = open_channels(
        me=rank,
        sends=[(env, "actions", action_message(spec, n)) for env in served],
        recvs=[(env, "observations", observation_message(spec, n)) for env in served],
        describe_rank=topology.describe, timeout=runtime.timeout)
    server = InferenceServer(policy, obs_channels, action_channels, runtime.device, weight_sync)
    run_inference_rank(server, plan.num_iterations, cfg.algo.num_steps, cfg.weights.verify_every)
    return policy


def _run_trainer(cfg, plan, runtime, topology: Topology, groups, spec, report) -> ActorCritic:
    rank = runtime.rank
    _seed_rank(cfg, rank)
    sources = topology.envs_trained_by(rank)
    n, t = cfg.env.num_envs, cfg.algo.num_steps
    policy = _make_policy(cfg, spec, runtime.device)
    weight_sync = None
    if rank == topology.trainer_ranks[0]:
        # Built before the optimizer and DDP: it may re-point the parameters into its flat buckets.
        weight_sync = WeightSync(policy, groups.weights, src=rank, me=rank,
                                 bucket_bytes=int(cfg.weights.bucket_mb * 2**20), timeout=runtime.timeout,
                                 describe_rank=topology.describe)
    ppo = _make_ppo(cfg, plan, policy, groups.trainer, len(topology.trainer_ranks) > 1)
    _, channels = open_channels(
        me=rank, sends=[],
        recvs=[(env, "segments", segment_message(spec, t, n)) for env in sources],
        describe_rank=topology.describe, timeout=runtime.timeout)
    trainer = Trainer(policy, ppo, channels, [topology.describe(e) for e in sources],
                      plan.max_env_columns_per_trainer * t, runtime.device,
                      groups.trainer if len(topology.trainer_ranks) > 1 else None, weight_sync,
                      describe=topology.describe(rank))
    run_trainer_rank(trainer, plan.num_iterations, cfg.weights.verify_every, report)
    return policy
