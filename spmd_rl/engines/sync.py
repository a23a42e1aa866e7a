"""The sync engine: one iteration is collect -> transfer -> learn -> broadcast weights -> next, and every rank's
sends and receives follow from the plan alone.

The loops below are the whole engine, one per role, side by side: in the colocated layout one rank runs all three
roles in turns; in the split layout each rank runs its role's loop. Every loop ends each iteration with the run's
agreement (checkpoints, stops) after the same iterations, so no rank waits there for one that must first pass it.
"""

from __future__ import annotations

from spmd_rl.interfaces.engine import Engine
from spmd_rl.interfaces.policy import Policy
from spmd_rl.run.metrics import MetricsLogger
from spmd_rl.run.setup import COLOCATED, ENV, INFERENCE, TRAINER, Run


class SyncEngine(Engine):
    """Every rank runs the story of its role; weights move at fixed points between rollouts."""

    def run(self, run: Run) -> Policy | None:
        loop = {COLOCATED: colocated_loop, ENV: env_loop, INFERENCE: inference_loop, TRAINER: trainer_loop}[run.role]
        return run.with_metrics(lambda logger: loop(run, logger))


def colocated_loop(run: Run, logger: MetricsLogger | None) -> None:
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
            metrics = trainer.learn(segment, iteration)
            report(iteration, metrics, trainer.gather_statistics(segment), trainer)
            run.end_iteration(
                iteration,
                lambda: {
                    **trainer.state_dict(),
                    "metrics": report.state_dict(),
                    **runner.checkpoint(),
                    **server.checkpoint(),
                },
            )
    finally:  # files are flushed and closed on every way out
        runner.close()
        trainer.close()


def env_loop(run: Run, logger: None = None) -> None:
    """Step the envs with the inference rank's actions; one segment per iteration to the trainer."""
    runner = run.build_env_runner()
    try:
        for iteration in run.iterations:
            runner.collect_segment(iteration)
            run.end_iteration(iteration, runner.checkpoint)
    finally:
        runner.close()


def inference_loop(run: Run, logger: None = None) -> None:
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
        run.end_iteration(iteration, server.checkpoint)  # the weights come from trainer 0; a recurrent state


def trainer_loop(run: Run, logger: MetricsLogger | None) -> None:
    """Learn from one segment per env rank per iteration; trainer 0 publishes the weights when the plan says."""
    plan = run.plan
    trainer, report = run.build_trainer(logger)
    try:
        # Inference ranks start from trainer rank 0's weights (initial or resumed).
        trainer.publish_weights(plan.version_at(run.iterations.start), verify=False)
        for iteration in run.iterations:
            segment = trainer.receive_segments(iteration, plan.version_at(iteration))
            metrics = trainer.learn(segment, iteration)
            if plan.syncs_after(iteration):
                version = plan.version_at(iteration + 1)
                trainer.publish_weights(version, verify=run.verifies(version))
            report(iteration, metrics, trainer.gather_statistics(segment), trainer)
            run.end_iteration(iteration, lambda: {**trainer.state_dict(), "metrics": report.state_dict()})
    finally:  # files are flushed and closed on every way out
        trainer.close()
