"""The run as an engine sees it on one rank (`Run`): the plan, this rank's role, builders that hand out role
components ready to use (channels open), and the run's control points: `restore` (the checkpoint the run resumes
from, into the components an engine runs), the end-of-iteration agreement (which saves what restore loads) and the
metrics report. Engines are loops over what it builds.

Every builder keeps one order of the steps that draw random numbers (policy, algorithm, the rank's seed, envs),
and restore sets the checkpoint's generators last, which is what makes a resumed run continue exactly.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from spmd_rl.config.sections import Config
from spmd_rl.envs.vector import EnvSpec
from spmd_rl.interfaces.algorithm import Algorithm
from spmd_rl.interfaces.policy import Policy, StepField
from spmd_rl.persist import rank_state
from spmd_rl.persist.rank_state import Component
from spmd_rl.persist.run_control import RunControl, StoppedWithCheckpoint
from spmd_rl.roles.env_runner import EnvRunner
from spmd_rl.roles.inference_server import InferenceParts, InferenceServer
from spmd_rl.roles.messages import observation_message
from spmd_rl.roles.pipelined_env_runner import PipelinedEnvRunner
from spmd_rl.roles.trainer import Trainer
from spmd_rl.run import builders
from spmd_rl.run.metrics import MetricsLogger
from spmd_rl.run.plan import Plan
from spmd_rl.run.policies import PrebuiltPolicy
from spmd_rl.run.report import Reporter
from spmd_rl.run.resume import Resume
from spmd_rl.run.topology import COLOCATED, ENV, INFERENCE, TRAINER, ProcessGroups, Topology
from spmd_rl.run.trackers import open_trackers
from spmd_rl.runtime.distributed import Runtime, agree_on_refusal
from spmd_rl.runtime.errors import SharedUserError, UserError
from spmd_rl.runtime.limits import peak_rss_mb

ROLES = (COLOCATED, ENV, INFERENCE, TRAINER)  # a rank's role travels as its index here (Run.rank_facts)


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
    # The policy's declared recurrent state per env (None: stateless), read with its outputs by the contract check
    # from its instance on the meta device: no rank builds the policy to learn it.
    recurrent_state: dict[str, StepField] | None
    built_before: int  # Policy.real_constructions before the run's checks: its policy_builds count from here
    run_dir: Path
    policy_cls: type[Policy] | None  # None on an env rank: it never imports the policy's module
    algorithm_cls: type[Algorithm]
    callback_classes: list  # [(class, config)]
    control: RunControl  # the end-of-iteration agreement: checkpoints and stops
    resume: Resume  # where the run starts (a checkpoint every rank loads, or iteration 0)
    final_policy: Policy | None = None  # rank 0's policy, saved as policy.pt at the end or on a stop
    # Trainer 0's policy when its checks before start built it to call act on (split layout with env ranks): its
    # builder takes it instead of building one
    prebuilt: PrebuiltPolicy | None = None
    _restored: bool = field(default=False, init=False, repr=False)  # restore() ran on this rank

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

    def policy_class(self) -> type[Policy]:
        """The policy's class, on a rank that builds the policy (an env rank has none)."""
        assert self.policy_cls is not None, f"{self.describe()} never builds the policy"
        return self.policy_cls

    def rank_facts(self) -> tuple[float, float, float, float]:
        """What the last agreement gathers of this rank for rank_records: its role (an index into ROLES), how many
        times it constructed the policy, its peak resident memory in MiB, whether it imported transformers."""
        builds = Policy.real_constructions - self.built_before
        return float(ROLES.index(self.role)), float(builds), peak_rss_mb(), float("transformers" in sys.modules)

    def rank_records(self) -> list[dict]:
        """finished.json's "ranks" (rank 0's, after the last agreement): each rank's role, how many times it
        constructed the policy on a real device (the checks before start read an instance on the meta device), its
        peak resident memory and whether it imported transformers (a VLA's backbone: never on an env rank)."""
        return [
            {
                "rank": rank,
                "role": ROLES[int(role)],
                "policy_builds": int(builds),
                "peak_rss_mb": round(rss, 1),
                "transformers_imported": bool(imported),
            }
            for rank, (role, builds, rss, imported) in enumerate(self.control.gathered_facts)
        ]

    def describe(self, rank: int | None = None) -> str:
        """'rank 2 (env 0)': how messages name a rank (this one by default)."""
        return self.topology.describe(self.rank if rank is None else rank)

    # -- control points --------------------------------------------------------------------------------------------

    def end_iteration(self, iteration: int, components: Mapping[str, Component]) -> None:
        """The end-of-iteration agreement of all ranks: a checkpoint (this rank's part: its components' states,
        rank_state.capture) and a stop on a signal happen here, at iterations every rank computes alike. Every
        rank must call it after the same iterations, with the components it gave restore()."""
        if callable(components):
            raise UserError(
                f"engine.class '{self.cfg.classes.get('engine', 'sync')}' passes a capture function to "
                f"run.end_iteration (the protocol before components owned their state): pass the components this "
                f"rank runs, {{name: component}}, and give the same to run.restore before the first iteration "
                f"(docs/plugins.md, Engine)"
            )
        if self.resume.checkpoint is not None and not self._restored:
            # Builders no longer restore: an engine that skips restore() would go on from fresh state, silently.
            raise UserError(
                f"engine.class '{self.cfg.classes.get('engine', 'sync')}' resumes from {self.resume.checkpoint} "
                f"but never called run.restore(components) on {self.describe()}; call it with this rank's "
                f"components before the first iteration (docs/plugins.md, Engine)"
            )
        self.control.after_iteration(iteration, lambda: rank_state.capture(components))

    def restore(self, components: Mapping[str, Component]) -> None:
        """Load the checkpoint the run resumes from into this rank's components (rank_state.restore; nothing on a
        fresh start), the generators last. Resharded (saved by another number of ranks, train.parallel=fsdp):
        trainers take the model and optimizer from the shard files and the rest of the learner's state from
        trainer 0's file, which all trainers shared; env and inference ranks start fresh, and so do every rank's
        random streams."""
        self._restored = True
        if self.resume.checkpoint is None:
            return
        state: dict | None = None
        refusal = ""
        try:  # every check a rank makes alone, before the sharded load (a collective of the trainers)
            if not self.resume.resharded:
                state = rank_state.load_state(self.resume.checkpoint, self.rank)
            elif rank_state.TRAINER in components:
                loaded = rank_state.load_state(self.resume.checkpoint, 0)
                state = {key: loaded[key] for key in rank_state.RESHARDED if key in loaded}
            rank_state.check(components, state)
        except UserError as exc:
            refusal = f"{self.describe()}: {exc}"
        if self.runtime.distributed:  # one rank's refusal is every rank's: none is left in a collective alone
            refusal = agree_on_refusal(refusal, self.runtime.timeout)
        if refusal:
            raise SharedUserError(refusal)
        rank_state.restore(components, state, generators=not self.resume.resharded)

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
                rollouts=plan.num_steps > 0,
                resumed_iteration=self.resume.iteration if self.resume.checkpoint is not None else None,
            )
            self.control.before_commit = logger.open_files  # a resume's files change with its first checkpoint
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

    # -- role components: built by run/builders.py, their state loaded by restore() ------------------------------

    def build_colocated(
        self, logger: MetricsLogger | None
    ) -> tuple[EnvRunner | PipelinedEnvRunner, InferenceServer, Trainer, Reporter]:
        """The colocated layout: this rank's envs, its own policy copy (the trainer's module is the one that acts)
        and data-parallel learning across ranks, joined by local channels; with env.pipeline_stages > 1, one runner
        per stage in a PipelinedEnvRunner, each stage's envs stepping on a thread of their own."""
        return builders.build_colocated(self, logger)

    def build_env_runner(self, observation_layout=observation_message) -> EnvRunner | PipelinedEnvRunner:
        """A split-layout env rank's runner: its envs, its channels (observations to its inference rank and actions
        back, segments to its trainer); with env.pipeline_stages > 1, one runner per stage in a PipelinedEnvRunner.
        observation_layout(spec, num_envs) lays out the observation message."""
        return builders.build_env_runner(self, observation_layout)

    def build_inference_server(self) -> InferenceServer:
        """A split-layout inference rank's server for the sync engine (fixed order, one forward pass a step)."""
        return builders.build_inference_server(self)

    def inference_parts(self, observation_layout=observation_message, recv_buffers: int = 1) -> InferenceParts:
        """An inference rank's policy (its weights come from trainer 0), weight sync and channels to and from its
        env ranks, for an engine that serves in its own way."""
        return builders.inference_parts(self, observation_layout, recv_buffers)

    def build_trainer(self, logger: MetricsLogger | None, recv_buffers: int = 1) -> tuple[Trainer, Reporter]:
        """A split-layout trainer rank's trainer (trainer 0's also publishes weights) and its report.
        recv_buffers: segment receives an engine may keep posted per env rank."""
        return builders.build_trainer(self, logger, recv_buffers)


__all__ = ["COLOCATED", "ENV", "INFERENCE", "TRAINER", "Run"]
