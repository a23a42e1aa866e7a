"""A user's engine, `engine.class: heldout_engine:HeldOutEvalEngine`: the sync engine, extended through its
`after_learn` hook with an evaluation of the policy on env settings it never trains on (e.g. Pendulum-v1 with a
stronger gravity) before every `every`-th weight sync, written to metrics.jsonl as heldout_return_mean /
heldout_return_std.

Written against spmd_rl.api only. The evaluation runs on the rank that writes the metrics (global rank 0: the
trainer in the split layout, the first rank colocated) on envs of its own, with a generator of its own: no rank
sends or receives anything it would not under `engine.class: sync`, and training's random streams are untouched
(the losses are the sync engine's, iteration for iteration). Every loop, checkpoint and resume is the sync
engine's own, so what it learns (a recurrent policy's state in checkpoints, say) this engine has too.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import gymnasium as gym

from spmd_rl.api import MetricsLogger, Run, SyncEngine, Trainer, UserError, evaluate, knob


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


class HeldOutEvalEngine(SyncEngine):
    """The sync engine on every rank; the metrics rank also plays held-out episodes before some syncs."""

    Config = HeldOutEvalConfig

    @classmethod
    def check_plan(cls, cfg, topology, plan, schedule) -> None:
        """Held-out settings the env does not take are refused before any rank starts, not at the first evaluation."""
        env = heldout_env(cfg.env, cfg.engine.kwargs)
        try:
            gym.make(env.id, **env.kwargs).close()
        except Exception as exc:  # whatever the env raises for a keyword it does not know
            raise UserError(f"engine.kwargs {cfg.engine.kwargs}: env.id '{env.id}' does not take them: {exc}") from None

    def after_learn(self, run: Run, trainer: Trainer, iteration: int, metrics: dict, logger: MetricsLogger | None):
        """Held-out metrics for this iteration: played only where the metrics are written, before the syncs the
        schedule picks (the weights about to ship are the ones measured)."""
        plan = run.plan
        if logger is None or not plan.syncs_after(iteration) or plan.version_at(iteration + 1) % self.config.every:
            return metrics
        result = evaluate(
            trainer.policy,
            heldout_env(run.cfg.env, self.config.kwargs),
            self.config.episodes,
            seed=run.cfg.train.seed,
            deterministic=self.config.deterministic,
        )  # same episodes each time
        return {**metrics, "heldout_return_mean": result["return_mean"], "heldout_return_std": result["return_std"]}


def heldout_env(env_cfg, kwargs: dict):
    """The training env section with the held-out settings laid over its kwargs."""
    return dataclasses.replace(env_cfg, kwargs={**env_cfg.kwargs, **kwargs})
