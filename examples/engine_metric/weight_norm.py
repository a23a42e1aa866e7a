"""A user's engine that adds a metric, for either built-in engine: `engine.class: weight_norm:SyncWeightNorm` or
`weight_norm:AsyncWeightNorm`. Every iteration's line of metrics.jsonl gains `weight_norm` (the L2 norm of the
policy's weights after learning) and `weight_norm_max` (the largest so far), whose running maximum is state of the
engine's own: checkpoints keep it and a resumed run goes on from it. Written against spmd_rl.api only; the loops,
checkpoints and resumes are the built-in engine's."""

import torch

from spmd_rl.api import AsyncEngine, SyncEngine


class LargestNorm:
    """The engine's own component: anything with state_dict() and load_state_dict(state)."""

    def __init__(self):
        self.value = 0.0

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]


class WeightNorm:
    """The two hooks, mixed into either engine."""

    def components(self, run):
        self.largest = LargestNorm()
        return {"largest_norm": self.largest}  # saved in checkpoints under this name

    def after_learn(self, run, trainer, iteration, metrics, logger):
        norm = float(torch.cat([p.detach().flatten() for p in trainer.policy.parameters()]).norm())
        self.largest.value = max(self.largest.value, norm)
        return {**metrics, "weight_norm": norm, "weight_norm_max": self.largest.value}


class SyncWeightNorm(WeightNorm, SyncEngine):
    pass


class AsyncWeightNorm(WeightNorm, AsyncEngine):
    pass
