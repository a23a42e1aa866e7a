"""The sync engine: one iteration is collect -> transfer -> learn -> broadcast weights -> next, and every rank's
sends and receives follow from the plan alone.

The loops below are the whole engine, one method per role, side by side: in the colocated layout one rank runs all
three roles in turns; in the split layout each rank runs its role's loop. Every loop ends each iteration with the
run's agreement (checkpoints, stops) after the same iterations, so no rank waits there for one that must first pass
it. A user's engine extends it by subclassing: `after_learn` (extra metrics, a held-out evaluation),
`before_sync`, and `checkpoint_state` (what a checkpoint holds), rather than by copying the loops.
"""

from __future__ import annotations

from collections.abc import Callable

from spmd_rl.interfaces.engine import Engine
from spmd_rl.interfaces.policy import Policy
from spmd_rl.roles.env_runner import EnvRunner
from spmd_rl.roles.inference_server import InferenceServer
from spmd_rl.roles.trainer import Trainer
from spmd_rl.run.metrics import MetricsLogger
from spmd_rl.run.report import Reporter
from spmd_rl.run.run import COLOCATED, ENV, INFERENCE, TRAINER, Run


class SyncEngine(Engine):
    """Every rank runs the story of its role; weights move at fixed points between rollouts."""

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

    def checkpoint_state(
        self,
        trainer: Trainer | None = None,
        report: Reporter | None = None,
        runner: EnvRunner | None = None,
        server: InferenceServer | None = None,
    ) -> dict:
        """What this rank's checkpoint holds, from the components it runs (the others are None). Extend it with
        `{**super().checkpoint_state(...), "mine": ...}`; restore what you add from run's checkpoint yourself."""
        state = {}
        if trainer is not None:
            state.update(trainer.state_dict())
        if report is not None:
            state["metrics"] = report.state_dict()
        if runner is not None:
            state.update(runner.checkpoint())
        if server is not None:
            state.update(server.checkpoint())  # a recurrent policy's per-env state
        return state

    # -- the loops -------------------------------------------------------------------------------------------------

    def colocated_loop(self, run: Run, logger: MetricsLogger | None) -> None:
        """All three roles in turns on this rank; the inference server acts with the trainer's own module, so every
        step acts with the latest weights."""
        plan = run.plan
        runner, server, trainer, report = run.build_colocated(logger)
        try:
            for iteration in run.iterations:
                server.policy_version = plan.version_at(iteration)
                server.explore_uniformly = plan.explores_at(iteration)
                for step in range(plan.num_steps):
                    runner.send_observations(step)
                    server.serve_step()
                    runner.receive_actions_and_step(step)
                runner.send_segment()
                segment = trainer.receive_segments(iteration, plan.version_at(iteration))
                metrics = self.after_learn(run, trainer, iteration, trainer.learn(segment, iteration), logger)
                if plan.syncs_after(iteration):
                    self.before_sync(run, trainer, iteration)
                report(iteration, metrics, trainer.gather_statistics(segment), trainer)
                run.end_iteration(iteration, lambda: self.checkpoint_state(trainer, report, runner, server))
        finally:  # files are flushed and closed on every way out
            runner.close()
            trainer.close()

    def env_loop(self, run: Run, logger: None = None) -> None:
        """Step the envs with the inference rank's actions; one segment per iteration to the trainer."""
        runner = run.build_env_runner()
        try:
            for iteration in run.iterations:
                runner.collect_segment(iteration)
                run.end_iteration(iteration, lambda: self.checkpoint_state(runner=runner))
        finally:
            runner.close()

    def inference_loop(self, run: Run, logger: None = None) -> None:
        """Serve every env rank in a fixed order, one forward pass a step; take new weights between rollouts."""
        plan = run.plan
        server = run.build_inference_server()
        server.receive_weights()  # the initial weights come from trainer rank 0, never from matching seeds
        for iteration in run.iterations:
            server.explore_uniformly = plan.explores_at(iteration)
            for _ in range(plan.num_steps):
                server.serve_step()
            if plan.syncs_after(iteration):
                server.take_weights(run.cfg.weights.verify_every)
            # the weights come from trainer 0; a recurrent state is the server's
            run.end_iteration(iteration, lambda: self.checkpoint_state(server=server))

    def trainer_loop(self, run: Run, logger: MetricsLogger | None) -> None:
        """Learn from one segment per env rank per iteration; trainer 0 publishes the weights when the plan says."""
        plan = run.plan
        trainer, report = run.build_trainer(logger)
        try:
            # Inference ranks start from trainer rank 0's weights (initial or resumed).
            trainer.publish_weights(plan.version_at(run.iterations.start), verify=False)
            for iteration in run.iterations:
                segment = trainer.receive_segments(iteration, plan.version_at(iteration))
                metrics = self.after_learn(run, trainer, iteration, trainer.learn(segment, iteration), logger)
                if plan.syncs_after(iteration):
                    self.before_sync(run, trainer, iteration)
                    version = plan.version_at(iteration + 1)
                    trainer.publish_weights(version, verify=run.verifies(version))
                report(iteration, metrics, trainer.gather_statistics(segment), trainer)
                run.end_iteration(iteration, lambda: self.checkpoint_state(trainer, report))
        finally:  # files are flushed and closed on every way out
            trainer.close()
