"""The Algorithm contract (learns on trainer ranks), its schedule, the facts of the plan it may check, and the
Callback contract."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from spmd_rl.config.sections import AlgorithmConfig, NoConfig
from spmd_rl.interfaces.context import Context
from spmd_rl.interfaces.policy import Policy

if TYPE_CHECKING:  # annotations only: importing tensordict costs seconds (torch._dynamo)
    from tensordict import TensorDict


@dataclass(frozen=True)
class Schedule:
    """When weights move and how the policy acts, per algorithm; the engine plans every rank's sends with it."""

    weight_sync_every: int = 1  # iterations between weight broadcasts to the inference ranks
    random_steps: int = 0  # env steps (all env ranks) acting uniformly at random before the policy acts
    max_policy_lag: int = 0  # policy versions a step may lag behind the learner (0: on-policy)


@dataclass(frozen=True)
class PlanFacts:
    """What an algorithm may check its config against before any process group exists."""

    trainer_ranks: int
    env_ranks: int
    steps_per_iteration: int  # all env ranks together
    samples_per_trainer: int  # env steps a trainer learns from per iteration
    num_iterations: int


class Algorithm:
    """Learns from the segments its trainer receives. Subclass it; set `Config` (a dataclass subclassing
    AlgorithmConfig, which gives `num_steps`), `default_policy` on the Config, and `requires`."""

    Config: ClassVar[type] = AlgorithmConfig
    requires: ClassVar[tuple[str, ...]] = ()  # step fields beyond obs/action/ENV_FIELDS (e.g. log_prob)
    policy_methods: ClassVar[tuple[str, ...]] = ()  # methods the policy must have (e.g. PPO: evaluate, value)

    @classmethod
    def schedule(cls, config: AlgorithmConfig) -> Schedule:
        return Schedule()

    @classmethod
    def check_plan(cls, config: AlgorithmConfig, plan: PlanFacts) -> None:
        """Raise spmd_rl.runtime.errors.UserError for a config that cannot work with this layout (runs before any
        process group, on every rank)."""

    @classmethod
    def summary(cls, config: AlgorithmConfig, plan: PlanFacts) -> str:
        """What rank 0 adds to the plan it prints at start (batch sizes and the like); '' for nothing."""
        return ""

    def __init__(self, policy: Policy, config: AlgorithmConfig, context: Context):
        self.policy = policy
        self.config = config
        self.context = context

    def learn(self, segment: TensorDict, iteration: int) -> dict[str, float]:
        """One iteration's learning; returns scalars for metrics.jsonl (the first trainer's are logged)."""
        raise NotImplementedError

    def state_dict(self) -> dict:
        """Everything beyond the policy's weights needed to continue exactly (optimizers, critics, ...)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def close(self) -> None:
        """Release files (replay shards); called once at the end, and on the way out after an error."""


class Callback:
    """Called on every trainer rank after every iteration. `metrics` is that iteration's record: on the first
    trainer (global rank 0) the whole metrics.jsonl line (episode returns, timings, evaluation results when
    `eval.every` asks); elsewhere iteration, env_steps and the algorithm's own scalars. Return scalars to add to
    metrics.jsonl and TensorBoard (the first trainer's are logged), or None."""

    Config: ClassVar[type] = NoConfig

    def __init__(self, config: Any, context: Context):
        self.config = config
        self.context = context

    def on_iteration_end(self, iteration: int, metrics: dict, algorithm: Algorithm) -> dict[str, float] | None:
        return None
