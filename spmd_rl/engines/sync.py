"""The sync engine: one iteration is collect -> transfer -> learn -> broadcast weights -> next, and every rank's
sends and receives follow from the plan alone.

The loops below are the whole engine, one method per role, side by side: in the colocated layout one rank runs all
three roles in turns; in the split layout each rank runs its role's loop. The colocated and trainer loops share one
learn step. Every loop restores its components from the checkpoint the run resumes from (`Run.restore`) and ends
each iteration with the run's agreement (checkpoints of the same components, stops) after the same iterations, so
no rank waits there for one that must first pass it.

A user's engine extends it by subclassing, rather than by copying the loops: `after_learn` (extra metrics, a
held-out evaluation), `before_sync`, and `components` (state of its own that checkpoints hold). The async engine
(engines/asynchronous/) is such a subclass too: it overrides where the loops' points differ (`agrees_after`, how
a trainer receives its segments, the inference rank's server), and so every hook works there alike.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import cast

from tensordict import TensorDict

from spmd_rl.interfaces.engine import Engine
from spmd_rl.interfaces.policy import Policy
from spmd_rl.persist import rank_state
from spmd_rl.persist.rank_state import Component
from spmd_rl.roles.env_runner import EnvRunner
from spmd_rl.roles.inference_server import InferenceServer
from spmd_rl.roles.messages import observation_message
from spmd_rl.roles.trainer import Trainer
from spmd_rl.run.metrics import MetricsLogger
from spmd_rl.run.report import Reporter
from spmd_rl.run.run import COLOCATED, ENV, INFERENCE, TRAINER, Run
from spmd_rl.runtime.watchdog import COLLECTIVE_MARGIN_S, watchdog

# A trainer's next segment, by iteration: (the segment, metrics of its receipt for the iteration's line).
SegmentSource = Callable[[int], tuple[TensorDict, dict]]


class SyncEngine(Engine):
    """Every rank runs the story of its role; weights move at fixed points between rollouts."""

    observation_layout = staticmethod(observation_message)  # how an env rank lays out its observation message

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "checkpoint_state" in vars(cls):
            warnings.warn(
                f"engine {cls.__module__}:{cls.__qualname__} overrides SyncEngine.checkpoint_state, which is "
                f"deprecated and goes in the next release: return your state's holders from components(run) instead "
                f"(docs/plugins.md); until then what it returns is saved under '{rank_state.CHECKPOINT_STATE_HOOK}'",
                DeprecationWarning,
                stacklevel=2,
            )

    def run(self, run: Run) -> Policy | None:
        loops: dict[str, Callable[..., None]] = {
            COLOCATED: self.colocated_loop,
            ENV: self.env_loop,
            INFERENCE: self.inference_loop,
            TRAINER: self.trainer_loop,
        }
        return run.with_metrics(lambda logger: loops[run.role](run, logger))

    # -- hooks: what a subclass overrides ----------------------------------------------------------------------------

    def after_learn(self, run: Run, trainer: Trainer, iteration: int, metrics: dict, logger: MetricsLogger | None):
        """The iteration's metrics, after learning and before any weight sync (trainer and colocated ranks; logger
        is None except where metrics are written). Return them, with extra scalars of your own if you like."""
        return metrics

    def before_sync(self, run: Run, trainer: Trainer, iteration: int) -> None:
        """Called on trainer and colocated ranks after an iteration the plan syncs after, before the weights of
        version plan.version_at(iteration + 1) ship (colocated: before the next rollout acts with them)."""

    def components(self, run: Run) -> dict[str, Component]:
        """Components of your own on this rank ({name: object with state_dict() and load_state_dict(state)}):
        checkpoints save each one's state under its name, and a resumed run loads it back before the first
        iteration. Called once per rank, after the role's components are built; run.role says which role."""
        return {}

    def agrees_after(self, run: Run, iteration: int) -> bool:
        """Whether every rank ends this iteration with the run's agreement (checkpoints, stops): the sync engine
        after each one."""
        return True

    def checkpoint_state(
        self,
        trainer: Trainer | None = None,
        report: Reporter | None = None,
        runner: EnvRunner | None = None,
        server: InferenceServer | None = None,
    ) -> dict:
        """Deprecated (kept for one release; `components` replaces it): what an override adds to this rank's
        checkpoints, `{**super().checkpoint_state(trainer, report, runner, server), "mine": ...}`, given the role
        components this rank runs (the others None). Saved under 'checkpoint_state'; restore it yourself, as
        before. The role components save their own state now, so this base adds nothing."""
        return {}

    # -- the parts every loop shares -------------------------------------------------------------------------------

    def restored(self, run: Run, role_components: dict[str, Component]) -> dict[str, Component]:
        """This rank's components, the role's and the engine's own, loaded from the checkpoint the run resumes
        from: what every agreement of the loop then saves."""
        own = self.components(run)
        rank_state.check_names(own, f"engine.class {type(self).__module__}:{type(self).__qualname__}")
        if type(self).checkpoint_state is not SyncEngine.checkpoint_state:  # the deprecated hook, as a component
            own[rank_state.CHECKPOINT_STATE_HOOK] = CheckpointStateHook(self, role_components)
        components = {**role_components, **own}
        run.restore(components)
        return components

    def end_iteration(self, run: Run, iteration: int, components: dict[str, Component]) -> None:
        if self.agrees_after(run, iteration):
            run.end_iteration(iteration, components)

    def learn_step(
        self, run: Run, trainer: Trainer, report: Reporter, iteration: int, segment, received: dict, logger
    ) -> None:
        """Learn from the iteration's segment, then the hooks, trainer 0's weight sync when the plan says, and the
        iteration's report (received: metrics of the segments' receipt, beside the algorithm's)."""
        plan = run.plan
        learned = {**trainer.learn(segment, iteration), **received}
        # The hooks are a subclass's code, bounded as the algorithm's learn is: in one process a hung hook hung the
        # run; with other ranks (60 s more: a hook may wait on them inside, and their wait should speak first) its
        # peers name the rank (fault pass 5, PH).
        engine = f"engine.class {type(self).__module__}:{type(self).__qualname__}"
        margin_s = COLLECTIVE_MARGIN_S if run.runtime.distributed else 0.0
        with watchdog.watch(f"{engine}'s after_learn (iteration {iteration})", margin_s):
            metrics = self.after_learn(run, trainer, iteration, learned, logger)
        if plan.syncs_after(iteration):
            with watchdog.watch(f"{engine}'s before_sync (iteration {iteration})", margin_s):
                self.before_sync(run, trainer, iteration)
            version = plan.version_at(iteration + 1)
            trainer.publish_weights(version, verify=run.verifies(version))  # colocated: nothing to publish
        report(iteration, metrics, trainer.gather_statistics(segment), trainer)

    def segment_source(self, run: Run, trainer: Trainer) -> SegmentSource:
        """How a trainer receives an iteration's segments: one from each env rank, every step acted with the
        iteration's version."""
        return lambda iteration: (trainer.receive_segments(iteration, run.plan.version_at(iteration)), {})

    segment_buffers = 1  # segment receives a trainer keeps posted per env rank

    # -- the loops -------------------------------------------------------------------------------------------------

    def colocated_loop(self, run: Run, logger: MetricsLogger | None) -> None:
        """All three roles in turns on this rank; the inference server acts with the trainer's own module, so every
        step acts with the latest weights."""
        plan = run.plan
        runner, server, trainer, report = run.build_colocated(logger)
        roles: dict[str, Component] = {
            rank_state.TRAINER: trainer,
            rank_state.REPORT: report,
            rank_state.ENV_RUNNER: runner,
            rank_state.INFERENCE_SERVER: server,
        }
        components = self.restored(run, roles)
        receive = self.segment_source(run, trainer)

        def rollout(iteration: int):
            """One rollout of this rank's envs, acting with the trainer's module, and its segment received."""
            runner.collect_segment_in_process(iteration, server.serve_stage)
            return receive(iteration)

        # Only here, where every rank steps its own envs, can an algorithm roll more rollouts within an iteration
        # (GRPO's algo.max_resample_rounds): its trainers agree on how many, and no other rank waits on them.
        trainer.algorithm.context.extra_rollout = lambda iteration: rollout(iteration)[0]
        try:
            for iteration in run.iterations:
                server.policy_version = plan.version_at(iteration)
                server.explore_uniformly = plan.explores_at(iteration)
                segment, received = rollout(iteration)
                self.learn_step(run, trainer, report, iteration, segment, received, logger)
                self.end_iteration(run, iteration, components)
        finally:  # files are flushed and closed on every way out
            runner.close()
            trainer.close()

    def env_loop(self, run: Run, logger: None = None) -> None:
        """Step the envs with the inference rank's actions; one segment per iteration to the trainer."""
        runner = run.build_env_runner(self.observation_layout)
        components = self.restored(run, {rank_state.ENV_RUNNER: runner})
        try:
            for iteration in run.iterations:
                runner.collect_segment(iteration)
                self.end_iteration(run, iteration, components)
        finally:
            runner.close()

    def inference_loop(self, run: Run, logger: None = None) -> None:
        """Serve every env rank in a fixed order, one forward pass a step; take new weights between rollouts."""
        plan = run.plan
        server = run.build_inference_server()
        components = self.restored(run, {rank_state.INFERENCE_SERVER: server})  # the weights come from trainer 0
        server.receive_weights()  # the initial weights come from trainer rank 0, never from matching seeds
        for iteration in run.iterations:
            server.explore_uniformly = plan.explores_at(iteration)
            for _ in range(plan.num_steps):
                server.serve_step()
            if plan.syncs_after(iteration):
                server.take_weights(run.cfg.weights.verify_every)
            self.end_iteration(run, iteration, components)

    def trainer_loop(self, run: Run, logger: MetricsLogger | None) -> None:
        """Learn from one segment per env rank per iteration; trainer 0 publishes the weights when the plan says."""
        trainer, report = run.build_trainer(logger, recv_buffers=self.segment_buffers)
        components = self.restored(run, {rank_state.TRAINER: trainer, rank_state.REPORT: report})
        try:
            # Inference ranks start from trainer rank 0's weights (initial or resumed).
            trainer.publish_weights(run.plan.version_at(run.iterations.start), verify=False)
            receive = self.segment_source(run, trainer)
            for iteration in run.iterations:
                segment, received = receive(iteration)
                self.learn_step(run, trainer, report, iteration, segment, received, logger)
                self.end_iteration(run, iteration, components)
        finally:  # files are flushed and closed on every way out
            trainer.close()


class CheckpointStateHook:
    """An engine's override of the deprecated SyncEngine.checkpoint_state as a component: each checkpoint saves what
    it returns for this rank's role components; a resume loads nothing back (the hook's engine restored its own)."""

    def __init__(self, engine: SyncEngine, role_components: dict[str, Component]):
        self.engine, self.roles = engine, role_components

    def state_dict(self) -> dict:
        roles = self.roles
        return self.engine.checkpoint_state(
            trainer=cast("Trainer | None", roles.get(rank_state.TRAINER)),
            report=cast("Reporter | None", roles.get(rank_state.REPORT)),
            runner=cast("EnvRunner | None", roles.get(rank_state.ENV_RUNNER)),
            server=cast("InferenceServer | None", roles.get(rank_state.INFERENCE_SERVER)),
        )

    def load_state_dict(self, state: dict) -> None:
        pass
