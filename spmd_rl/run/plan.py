"""The plan: every rank's schedule (iterations, batch sizes, when weights move, when actions are random), derived
from the config and the topology alone, so every rank knows its whole schedule before the first message. Every
layout and schedule check lives here, or in the hooks it calls (the algorithm's and the engine's `check_plan`)."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, replace

from spmd_rl.comm.parallel_plan import ParallelPlan
from spmd_rl.config import plugins
from spmd_rl.config.sections import Config, EnvSection
from spmd_rl.envs.backend import backend_for
from spmd_rl.interfaces.algorithm import Algorithm, PlanFacts, Schedule
from spmd_rl.interfaces.engine import Engine
from spmd_rl.run.topology import Topology
from spmd_rl.runtime.errors import UserError


@dataclass(frozen=True)
class Plan:
    env_ranks: int
    trainer_ranks: int
    envs_total: int
    num_steps: int  # decisions per env per iteration (the rollout length; env steps without action chunks; 0: none)
    steps_per_iteration: int  # primitive env steps per iteration, all env ranks together (decisions x chunk)
    num_iterations: int
    max_env_columns_per_trainer: int  # env columns of the busiest trainer
    sync_every: int  # iterations between weight broadcasts
    explore_iterations: int  # first iterations acting uniformly at random (off-policy warm-up)
    # The env section with its counts per env rank resolved (env.total_envs and the groups' total_envs spread over
    # the env ranks into num_envs): what every env rank makes. The config itself stays as the command gave it.
    # (None only in a Plan built by hand, e.g. in a test of a component: plan_run always sets it.)
    env: EnvSection | None = None
    parallel: ParallelPlan = ParallelPlan()  # how the trainers hold the policy (sharded or not, shard groups)
    action_chunk: int = 1  # env.action_chunk: primitive env steps per decision
    episodes: bool = False  # a rollout is whole episodes (the algorithm's Schedule.rollout_unit), num_steps decisions
    colocated: bool = True  # the layout: every rank plays every role (not split into env, inference and trainer ranks)

    @property
    def decisions_per_iteration(self) -> int:
        """The policy's decisions per iteration, all env ranks together: the samples an on-policy algorithm
        learns from (env steps without action chunks)."""
        return self.steps_per_iteration // self.action_chunk

    def run_config(self, cfg: Config) -> Config:
        """The config the run executes and config.yaml records: the given one with the env counts resolved."""
        assert self.env is not None  # plan_run sets it
        return replace(cfg, env=self.env)

    def version_at(self, iteration: int) -> int:
        """The policy version every env step of this iteration must use (broadcasts so far)."""
        return iteration // self.sync_every

    def syncs_after(self, iteration: int) -> bool:
        return (iteration + 1) % self.sync_every == 0

    def explores_at(self, iteration: int) -> bool:
        return iteration < self.explore_iterations

    def facts(self, asked_policy_lag: int | None = None) -> PlanFacts:
        return PlanFacts(
            asked_policy_lag=asked_policy_lag,
            trainer_ranks=self.trainer_ranks,
            env_ranks=self.env_ranks,
            steps_per_iteration=self.steps_per_iteration,
            samples_per_trainer=self.decisions_per_iteration // self.trainer_ranks,
            num_iterations=self.num_iterations,
            action_chunk=self.action_chunk,
            group_size=self.env.group_size if self.env is not None else 1,
            colocated=self.colocated,
        )

    def describe(self, cfg: Config, world_size: int, layout: str, algorithm_cls: type[Algorithm]) -> str:
        assert self.env is not None  # plan_run sets it
        summary = algorithm_cls.summary(cfg.algo, self.facts())
        if not self.num_steps:  # no rollouts (Schedule.rollout_unit "none"): the envs only evaluate
            text = (
                f"{cfg.classes['algo']} (policy {cfg.classes['policy']}) for {cfg.env.id}; world size {world_size}, "
                f"layout {layout}; {self.trainer_ranks} trainer rank(s); {self.num_iterations} iterations, no env "
                f"steps (no rollouts)"
            )
            return text + (f"; {summary}" if summary else "")
        text = (
            f"{cfg.classes['algo']} (policy {cfg.classes['policy']}) on {cfg.env.id}; world size {world_size}, "
            f"layout {layout}; {self.env_ranks} env rank(s) x {self.env.num_envs} envs = {self.envs_total} envs"
            f"{' (env.total_envs)' if self.env.total_envs and not self.env.groups else ''}{_group_counts(self.env)}; "
            f"{self.steps_per_iteration} env steps per iteration ({self.num_steps} steps x {self.envs_total} "
            f"envs{_chunk_factor(self.action_chunk)}); {self.trainer_ranks} trainer rank(s); "
            f"{self.num_iterations} iterations = "
            f"{self.num_iterations * self.steps_per_iteration} env steps"
        )
        whole, left = divmod(cfg.train.total_steps, self.steps_per_iteration)
        if left and self.num_iterations == whole:  # a run is whole iterations (a dry run is one: not this)
            text += f" (train.total_steps={cfg.train.total_steps} rounded down to whole iterations)"
        if self.episodes:
            text += f"; rollouts of whole episodes from a reset ({self.num_steps} decisions, finished envs inactive)"
        if self.explore_iterations:
            text += f"; {self.explore_iterations} iteration(s) of uniform random actions first"
        if self.sync_every > 1 and layout.startswith("split"):
            text += f"; weights broadcast every {self.sync_every} iterations"
        return text + (f"; {summary}" if summary else "")


def _chunk_factor(action_chunk: int) -> str:
    """' x 4 actions per chunk' with env.action_chunk 4, nothing without chunks."""
    return f" x {action_chunk} actions per chunk" if action_chunk > 1 else ""


def _group_counts(env: EnvSection) -> str:
    """' in groups a (4 per env rank), b (4 per env rank)', or nothing without env.groups."""
    if not env.groups:
        return ""
    return " in groups " + ", ".join(f"{g.name} ({g.num_envs} per env rank)" for g in env.groups)


def spread_total_envs(given: EnvSection, topology: Topology) -> EnvSection:
    """A copy of the env section in which env.total_envs, when set, is env.num_envs per env rank: the same global
    batch at any world size.

    With env.groups, every env rank hosts every group: a group's total_envs (its own, else env.total_envs when it
    gives no num_envs) becomes its num_envs per env rank, a group without counts takes env.num_envs, and
    env.num_envs becomes the sum, the width of every env rank's vector env."""
    env, env_ranks = copy.deepcopy(given), len(topology.env_ranks)
    if not env.groups:
        if env.total_envs:
            env.num_envs = _per_env_rank(env.total_envs, env_ranks, "env.total_envs")
        return env
    for i, group in enumerate(env.groups):
        what = f"env.groups[{i}].total_envs (group '{group.name}')"
        if not group.total_envs and not group.num_envs:
            # Inherited as env gives it, and written into the group, so config.yaml reads back the same.
            group.total_envs, group.num_envs = env.total_envs, env.num_envs
            what = f"env.total_envs (inherited by group '{group.name}')"
        if group.total_envs:
            group.num_envs = _per_env_rank(group.total_envs, env_ranks, what)
    env.num_envs = sum(group.num_envs for group in env.groups)
    return env


def _episode_rollouts(rollout_unit: str, cfg: Config) -> bool:
    """Whether the algorithm's rollouts are whole episodes (Schedule.rollout_unit)."""
    if rollout_unit not in ("window", "episode", "none"):
        raise UserError(
            f"algo.class '{cfg.classes['algo']}' asks for rollout_unit '{rollout_unit}' in its schedule; it must be "
            f"'window', 'episode' or 'none'"
        )
    return rollout_unit == "episode"


def _rollout_length(schedule: Schedule, env: EnvSection, cfg: Config) -> int:
    """Decisions per env per iteration: algo.num_steps, those of a whole episode, or 0 without rollouts."""
    if schedule.rollout_unit == "none":
        if schedule.iterations < 1:
            raise UserError(
                f"algo.class '{cfg.classes['algo']}' rolls out nothing (rollout_unit 'none') and states "
                f"{schedule.iterations} iterations in its schedule; it must state 1 or more"
            )
        return 0
    if _episode_rollouts(schedule.rollout_unit, cfg):
        return math.ceil(_episode_step_limit(env) / env.action_chunk)
    return cfg.algo.num_steps


def _episode_step_limit(env: EnvSection) -> int:
    """The most primitive steps an episode runs, so in a rollout of whole episodes: the env's own limit, or
    env.max_episode_steps where lower. The rollout's length follows from it, never from where episodes end."""
    limit = backend_for(env).step_limit(env)
    if not limit:
        raise UserError(
            f"the algorithm rolls out whole episodes, and env '{env.id}' states no step limit: set "
            f"env.max_episode_steps (the most steps an episode runs in one rollout)"
        )
    return limit


def _check_group_size(env: EnvSection) -> None:
    """env.group_size: a block of envs that start together lies within one env rank (and so one trainer) and within
    one of env.groups' groups: every count per env rank is a multiple of it."""
    size = env.group_size
    counts = [(f"env.groups[{i}] ('{g.name}')", g.num_envs) for i, g in enumerate(env.groups)] or [
        ("env", env.num_envs)
    ]
    for what, count in counts:
        if count % size:
            raise UserError(
                f"env.group_size={size} does not divide the {count} envs of {what} on each env rank: a group "
                f"never spans env ranks; make env.num_envs (or env.total_envs / env ranks) a multiple of {size}"
            )


def _check_pipeline_stages(env: EnvSection, topology: Topology) -> None:
    """env.pipeline_stages: an env rank's envs in equal stages, each of whole env.group_size blocks. In the
    colocated layout the policy acts on the rank's own thread while a stage steps on another, which overlaps only
    where the step waits without holding the GIL (env.vectorization=async's worker processes, EnvPool's C++
    threads): vectorizers that step in Python are refused, not warned about, since their stages would only cost
    time."""
    stages = env.pipeline_stages
    if stages == 1:
        return
    if topology.colocated and not backend_for(env).steps_without_the_gil(env):
        raise UserError(
            f"env.pipeline_stages={stages} in the colocated layout overlaps env steps with the policy only where "
            f"they run outside Python (worker processes, EnvPool), and env.backend={env.backend} with "
            f"env.vectorization={env.vectorization} steps them in this process: set env.vectorization=async "
            f"(env.backend=gymnasium), use layout.mode=split, or env.pipeline_stages=1"
        )
    if env.groups:
        raise UserError(
            f"env.pipeline_stages={stages} with env.groups is not supported (a stage would cut the groups' mixed "
            f"vector env): set env.pipeline_stages=1, or run one env id"
        )
    if env.num_envs % stages:
        raise UserError(
            f"env.pipeline_stages={stages} does not divide the {env.num_envs} envs of each env rank: stages are "
            f"equal; make env.num_envs (or env.total_envs / env ranks) a multiple of {stages}"
        )
    per_stage = env.num_envs // stages
    if per_stage % env.group_size:
        raise UserError(
            f"env.pipeline_stages={stages} would split the env.group_size={env.group_size} blocks: each stage "
            f"holds {per_stage} envs; make env.num_envs / env.pipeline_stages a multiple of {env.group_size}"
        )


def _per_env_rank(total: int, env_ranks: int, what: str) -> int:
    if total % env_ranks:
        raise UserError(
            f"{what}={total} cannot be shared equally by {env_ranks} env ranks; make it a multiple of "
            f"{env_ranks}, or run with a number of env ranks that divides it"
        )
    return total // env_ranks


def _parallel_plan(cfg: Config, topology: Topology, algorithm_cls: type[Algorithm]) -> ParallelPlan:
    """The parallel plan, checked: train.parallel / train.shard_group_size / train.precision / inference.dtype
    against what the rest of the config asks for."""
    trainers = tuple(range(topology.world_size)) if topology.colocated else tuple(topology.trainer_ranks)
    parallel = ParallelPlan.from_config(cfg.train, trainers, split=not topology.colocated)
    if parallel.sharded:
        if not algorithm_cls.supports_fsdp:
            raise UserError(
                f"train.parallel=fsdp: algo.class '{cfg.classes['algo']}' does not train through "
                f"Context.data_parallel (it averages its gradients itself); use train.parallel=ddp"
            )
        if cfg.train.skip_nonfinite_updates:
            raise UserError(
                "train.parallel=fsdp with train.skip_nonfinite_updates is not supported (each trainer sees only "
                "its shards of the weights); set train.skip_nonfinite_updates=false"
            )
    parallel.check()
    if cfg.inference.dtype != "fp32" and topology.colocated:
        raise UserError(
            f"inference.dtype={cfg.inference.dtype} is for the inference ranks of a split layout; in the colocated "
            f"layout the trainer's own module acts: use train.precision=bf16 instead"
        )
    return parallel


def plan_run(cfg: Config, topology: Topology, algorithm_cls: type[Algorithm]) -> Plan:
    """Every rank's schedule, from the config and the topology alone; the algorithm checks its own constraints.
    The config is left as given; the plan carries the env counts per env rank (plan.env, plan.run_config)."""
    env = spread_total_envs(cfg.env, topology)
    _check_group_size(env)
    _check_pipeline_stages(env, topology)
    env_ranks = len(topology.env_ranks)
    envs_total = env_ranks * env.num_envs
    schedule = algorithm_cls.schedule(cfg.algo)
    chunk = env.action_chunk
    episodes = _episode_rollouts(schedule.rollout_unit, cfg)
    num_steps = _rollout_length(schedule, env, cfg)
    if chunk > 1 and not algorithm_cls.supports_action_chunks:
        raise UserError(
            f"env.action_chunk={chunk}: algo.class '{cfg.classes['algo']}' learns from single actions, not action "
            f"chunks; set env.action_chunk=1 or choose an algorithm that takes chunks (ppo, grpo)"
        )
    # A decision counts as its whole chunk, also where an episode's end stops it early (as a reset step counts as
    # a step): the schedule follows from the config alone, never from where episodes end.
    steps_per_iteration = envs_total * num_steps * chunk
    num_iterations = cfg.train.total_steps // steps_per_iteration if num_steps else schedule.iterations
    if num_iterations < 1:
        # A rollout of whole episodes is as long as the episode step limit, whatever algo.num_steps says.
        length = f"{num_steps} decisions of a whole episode (env.max_episode_steps" if episodes else "algo.num_steps"
        length += " or the env's step limit)" if episodes else ""
        shorter = ", or lower env.max_episode_steps" if episodes else ""
        raise UserError(
            f"train.total_steps={cfg.train.total_steps} is less than one iteration "
            f"({steps_per_iteration} env steps = {length} x env.num_envs x {env_ranks} env ranks"
            f"{' x env.action_chunk' if chunk > 1 else ''}); raise train.total_steps to at least "
            f"{steps_per_iteration}{shorter}"
        )
    env_ranks_per_trainer = [len(topology.envs_trained_by(t)) for t in topology.trainer_ranks]
    if len(set(env_ranks_per_trainer)) > 1:
        # DDP (and gradient averaging) weighs every trainer equally: unequal shares would overweight the samples
        # of the trainers with fewer env ranks.
        raise UserError(
            f"layout.env={len(topology.env_ranks)} env ranks cannot be shared equally by "
            f"layout.trainer={len(topology.trainer_ranks)} trainers; make layout.env a multiple of "
            f"layout.trainer"
        )
    parallel = _parallel_plan(cfg, topology, algorithm_cls)
    plan = Plan(
        env_ranks=env_ranks,
        trainer_ranks=len(topology.trainer_ranks),
        envs_total=envs_total,
        num_steps=num_steps,
        steps_per_iteration=steps_per_iteration,
        num_iterations=num_iterations,
        max_env_columns_per_trainer=max(env_ranks_per_trainer) * env.num_envs,
        sync_every=schedule.weight_sync_every,
        explore_iterations=math.ceil(schedule.random_steps / steps_per_iteration) if num_steps else 0,
        env=env,
        action_chunk=chunk,
        episodes=episodes,
        parallel=parallel,
        colocated=topology.colocated,
    )
    engine_cls = plugins.load_class(plugins.ENGINE, cfg.classes.get("engine", "sync"), Engine)
    algorithm_cls.check_plan(cfg.algo, plan.facts(engine_cls.asked_policy_lag(cfg.engine)))
    # An engine may refuse a layout or a schedule it cannot run (e.g. the async engine: split layouts only).
    engine_check = getattr(engine_cls, "check_plan", None)
    if engine_check is not None:
        engine_check(plan.run_config(cfg), topology, plan, schedule)
    return plan


def dry_run_plan(plan: Plan) -> Plan:
    """`--dry-run`: one real iteration, ending with a weight sync, so every role, channel and collective runs."""
    return replace(plan, num_iterations=1, sync_every=1, explore_iterations=0)
