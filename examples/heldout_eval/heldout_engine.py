"""A user's engine, `engine.class: heldout_engine:HeldOutEvalEngine`: the sync engine's loops, plus an evaluation of
the policy on env settings it never trains on (e.g. Pendulum-v1 with a stronger gravity) before every `every`-th
weight sync, written to metrics.jsonl as heldout_return_mean / heldout_return_std.

Written against spmd_rl.api only, with the names the built-in engines use. The evaluation runs on the rank that
writes the metrics (global rank 0: the trainer in the split layout, the first rank colocated) on envs of its own,
with a generator of its own: no rank sends or receives anything it would not under `engine.class: sync`, and
training's random streams are untouched (the losses are the sync engine's, iteration for iteration).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import gymnasium as gym

from spmd_rl.api import (
    COLOCATED,
    ENV,
    INFERENCE,
    TRAINER,
    Engine,
    MetricsLogger,
    Policy,
    Run,
    Trainer,
    UserError,
    evaluate,
    knob,
)


@dataclass
class HeldOutEvalConfig:
    every: int = knob(2, "evaluate on the held-out settings before every this-many-th weight sync", min=1)
    kwargs: dict = knob(
        None,
        "the held-out env settings: gymnasium.make keyword arguments laid over env.kwargs "
        "(e.g. {g: 12.0} for Pendulum-v1)",
        factory=dict,
    )
    episodes: int = knob(4, "episodes per held-out evaluation", min=1)
    deterministic: bool = knob(True, "act with the policy's mode (mean action) rather than sampling")


class HeldOutEvalEngine(Engine):
    """The sync engine's story on every rank; the metrics rank also plays held-out episodes before some syncs."""

    Config = HeldOutEvalConfig

    def run(self, run: Run) -> Policy | None:
        loop = {COLOCATED: self.colocated_loop, ENV: env_loop, INFERENCE: inference_loop, TRAINER: self.trainer_loop}[
            run.role
        ]
        return run.with_metrics(lambda logger: loop(run, logger))

    @classmethod
    def check_plan(cls, cfg, topology, plan, schedule) -> None:
        """Held-out settings the env does not take are refused before any rank starts, not at the first evaluation."""
        env = heldout_env(cfg.env, cfg.engine.kwargs)
        try:
            gym.make(env.id, **env.kwargs).close()
        except Exception as exc:  # whatever the env raises for a keyword it does not know
            raise UserError(f"engine.kwargs {cfg.engine.kwargs}: env.id '{env.id}' does not take them: {exc}") from None

    def heldout(self, run: Run, trainer: Trainer, iteration: int, logger: MetricsLogger | None) -> dict[str, float]:
        """Held-out metrics for this iteration: played only where the metrics are written, before the syncs the
        schedule picks (the weights about to ship are the ones measured)."""
        plan = run.plan
        if logger is None or not plan.syncs_after(iteration) or plan.version_at(iteration + 1) % self.config.every:
            return {}
        result = evaluate(
            trainer.policy,
            heldout_env(run.cfg.env, self.config.kwargs),
            self.config.episodes,
            seed=run.cfg.train.seed,
            deterministic=self.config.deterministic,
        )  # same episodes each time
        return {"heldout_return_mean": result["return_mean"], "heldout_return_std": result["return_std"]}

    def colocated_loop(self, run: Run, logger: MetricsLogger | None) -> None:
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
                metrics = {**metrics, **self.heldout(run, trainer, iteration, logger)}
                report(iteration, metrics, trainer.gather_statistics(segment), trainer)
                run.end_iteration(
                    iteration, lambda: {**trainer.state_dict(), "metrics": report.state_dict(), **runner.checkpoint()}
                )
        finally:
            runner.close()
            trainer.close()

    def trainer_loop(self, run: Run, logger: MetricsLogger | None) -> None:
        plan = run.plan
        trainer, report = run.build_trainer(logger)
        try:
            trainer.publish_weights(plan.version_at(run.iterations.start), verify=False)
            for iteration in run.iterations:
                segment = trainer.receive_segments(iteration, plan.version_at(iteration))
                metrics = trainer.learn(segment, iteration)
                metrics = {**metrics, **self.heldout(run, trainer, iteration, logger)}  # before the sync
                if plan.syncs_after(iteration):
                    version = plan.version_at(iteration + 1)
                    trainer.publish_weights(version, verify=run.verifies(version))
                report(iteration, metrics, trainer.gather_statistics(segment), trainer)
                run.end_iteration(iteration, lambda: {**trainer.state_dict(), "metrics": report.state_dict()})
        finally:
            trainer.close()


def heldout_env(env_cfg, kwargs: dict):
    """The training env section with the held-out settings laid over its kwargs."""
    return dataclasses.replace(env_cfg, kwargs={**env_cfg.kwargs, **kwargs})


# The env and inference ranks run exactly the sync engine's loops.


def env_loop(run: Run, logger: None = None) -> None:
    runner = run.build_env_runner()
    try:
        for iteration in run.iterations:
            runner.collect_segment(iteration)
            run.end_iteration(iteration, runner.checkpoint)
    finally:
        runner.close()


def inference_loop(run: Run, logger: None = None) -> None:
    plan = run.plan
    server = run.build_inference_server()
    server.receive_weights()  # the initial weights come from trainer rank 0
    for iteration in run.iterations:
        server.explore_uniformly = plan.explores_at(iteration)
        for _ in range(plan.num_steps):
            server.serve_step()
        if plan.syncs_after(iteration):
            server.take_weights(run.cfg.weights.verify_every)
        run.end_iteration(iteration, dict)
