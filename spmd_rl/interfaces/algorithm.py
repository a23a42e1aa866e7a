"""The Algorithm contract (learns on trainer ranks), its schedule, the facts of the plan it may check, and the
Callback contract."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

import gymnasium as gym

from spmd_rl.config.sections import AlgorithmConfig, NoConfig
from spmd_rl.interfaces.context import Context
from spmd_rl.interfaces.policy import Policy

if TYPE_CHECKING:  # annotations only: importing tensordict costs seconds (torch._dynamo)
    from tensordict import TensorDict


# Schedule.max_policy_lag of an algorithm that learns from steps of any age (off-policy, e.g. SAC): the async
# engine then bounds the lag by engine.max_policy_lag alone, or by its backpressure when that is unset.
ANY_LAG = 2**31 - 1


@dataclass(frozen=True)
class Schedule:
    """When weights move and how the policy acts, per algorithm; the engine plans every rank's sends with it."""

    weight_sync_every: int = 1  # iterations between weight broadcasts to the inference ranks
    random_steps: int = 0  # env steps (all env ranks) acting uniformly at random before the policy acts
    max_policy_lag: int = 0  # policy versions a step may lag behind the learner (0: on-policy; ANY_LAG: any)
    # What one rollout is: "window", algo.num_steps decisions that episodes span (autoreset within it); or "episode",
    # every env from a reset until its episode ends, envs whose episode has ended masked inactive (rollout["active"])
    # for the rollout's fixed ceil(max episode steps / env.action_chunk) decisions; or "none", no rollout at all: an
    # algorithm that learns from data of its own (bc's demonstrations) steps no env, and its segments are empty.
    rollout_unit: str = "window"
    # With rollout_unit "none": how many iterations the run has (train.total_steps counts env steps: none are taken).
    iterations: int = 0


# What the contract check knows of a returned tensor by its name: [B] for these, [B, *action shape] for "action"
# (the shape of the action act() returns), [B, ...] for any other name.
PER_SAMPLE_SCALARS = ("log_prob", "entropy", "value")


@dataclass(frozen=True)
class PolicyMethod:
    """A method an Algorithm calls on its policy, with its signature: listed in `Algorithm.policy_methods`, it is
    called before any process group exists on a batch of B sample observations (and the actions act() gave for
    them), without grad, and what it returns is checked; a policy that lacks it, fails in it or returns something
    else stops the run with exit 2 naming the policy class and this signature.

    args: what it is called with, in order: "obs" (a batch [B, ...] as the env gives it: a tensor, or a TensorDict
        for Dict spaces) and/or "action" (a batch [B, *action shape], as act() returns it).
    returns: the name of the one tensor it returns, or a tuple of names for a tuple of tensors. Each has the batch
        as its first dimension; log_prob, entropy and value are [B], action is [B, *action shape].
    note: shown with a failure: what the algorithm needs it for, or how to write it.
    A method named "forward" is called as policy(*args), the way DDP (context.data_parallel) calls it."""

    name: str
    args: tuple[str, ...] = ("obs",)
    returns: str | tuple[str, ...] = "value"
    note: str = ""

    def signature(self) -> str:
        returns = self.returns if isinstance(self.returns, str) else f"({', '.join(self.returns)})"
        return f"{self.name}({', '.join(self.args)}) -> {returns}"


def loss_forward(caller: str, to_return: str) -> PolicyMethod:
    """forward(obs, action) -> (log_prob, entropy, value): what a loss calls as policy(obs, action), so that DDP's
    wrapper (context.data_parallel) sees the call; `to_return` tells a policy's author what forward must return."""
    return PolicyMethod(
        "forward",
        ("obs", "action"),
        ("log_prob", "entropy", "value"),
        f"{caller} calls the policy as policy(obs, action), which DDP wraps: define forward(self, obs, action) to "
        f"return {to_return}",
    )


# loss_forward's `to_return` for an algorithm that learns no value (bc, GRPO).
UNLEARNED_VALUE = "(log_prob, entropy, value) (the value is not learned: return any [B] tensor, e.g. zeros)"


@dataclass(frozen=True)
class PlanFacts:
    """What an algorithm may check its config against before any process group exists."""

    trainer_ranks: int
    env_ranks: int
    steps_per_iteration: int  # all env ranks together
    samples_per_trainer: int  # env steps a trainer learns from per iteration
    num_iterations: int
    # The policy lag the engine's config asks to act with (Engine.asked_policy_lag: the async engine's
    # engine.max_policy_lag); None where it asks for none beyond the algorithm's schedule.
    asked_policy_lag: int | None = None
    action_chunk: int = 1  # env.action_chunk: primitive env steps per decision (samples count decisions)
    group_size: int = 1  # env.group_size: consecutive env columns that start from one initial state
    colocated: bool = True  # every rank plays every role (one process, or layout.mode colocated), not split


# The Config class an Algorithm subclass learns with (Algorithm[PPOConfig]): what its classmethods and self.config see.
ConfigT = TypeVar("ConfigT", bound=AlgorithmConfig)


class Algorithm(Generic[ConfigT]):
    """Learns from the segments its trainer receives. Subclass it; set `Config` (a dataclass subclassing
    AlgorithmConfig, which gives `num_steps`), `default_policy` on the Config (a `ClassVar[str]`: as a field it
    would be a config key, which is refused), `requires` and `policy_methods`.

    `policy_methods` lists what `learn` calls on the policy beyond `act`: each a PolicyMethod (its signature, called
    and checked before start) or a bare name (only checked to exist). PPO's:
        PolicyMethod("evaluate", ("obs", "action"), ("log_prob", "entropy", "value")),
        PolicyMethod("value", ("obs",), "value"),
        PolicyMethod("forward", ("obs", "action"), ("log_prob", "entropy", "value"))  # its loss goes through DDP
    """

    Config: ClassVar[type] = AlgorithmConfig
    # step fields beyond obs/action/ENV_FIELDS (e.g. log_prob; SUCCESS_FIELDS where the env reports success)
    requires: ClassVar[tuple[str, ...]] = ()
    policy_methods: ClassVar[tuple[PolicyMethod | str, ...]] = ()  # what learn calls on the policy (see above)
    # Whether train.parallel=fsdp can shard it: true for algorithms whose gradients come from modules they got from
    # Context.data_parallel (PPO's) or Context.shard with Context.backward (SAC's); false for one that computes and
    # averages its gradients by hand (torch.autograd.grad and average_gradients bypass FSDP's reduce-scatter).
    supports_fsdp: ClassVar[bool] = True
    # Why a checkpoint of this algorithm cannot be resumed on another number of trainers ('' when it can): a resharded
    # resume takes the model and optimizer from the shard files and the rest of the learner's state from trainer 0's
    # file, which is wrong for state each trainer holds its own part of (a replay shard).
    reshard_refusal: ClassVar[str] = ""
    # Whether it learns from action chunks (env.action_chunk > 1: reward [T, N, K] and chunk_valid in the rollout,
    # actions [K, *shape]); false refuses such a config before any process group exists.
    supports_action_chunks: ClassVar[bool] = False

    @classmethod
    def takes_policy_on_meta(cls, config: ConfigT) -> bool:
        """Whether its constructor reads no value of the policy (nor copies it) before laying it out with
        Context.data_parallel: then sharded trainers (train.parallel=fsdp) hand it the policy on the meta device,
        and data_parallel gives each trainer only its own shards' values (trainer 0's build, tensor by tensor), so
        no other trainer builds or holds the whole policy. False (the default) hands it the policy built."""
        return False

    @classmethod
    def schedule(cls, config: ConfigT) -> Schedule:
        return Schedule()

    @classmethod
    def required_fields(cls, config: ConfigT) -> tuple[str, ...]:
        """The step fields this config learns from (checked before start): `requires`, unless a key adds some (GRPO's
        algo.outcome=success adds the success fields)."""
        return cls.requires

    @classmethod
    def check_plan(cls, config: ConfigT, plan: PlanFacts) -> None:
        """Raise spmd_rl.runtime.errors.UserError for a config that cannot work with this layout (runs before any
        process group, on every rank)."""

    @classmethod
    def check_spaces(cls, config: ConfigT, observation_space: gym.Space[Any], action_space: gym.Space[Any]) -> None:
        """Raise spmd_rl.runtime.errors.UserError for data of its own that does not fit the env's spaces as the
        policy sees them (bc's demonstrations: their observation and action layout); runs before any process group,
        on every rank, after the policy's contract check."""

    @classmethod
    def summary(cls, config: ConfigT, plan: PlanFacts) -> str:
        """What rank 0 adds to the plan it prints at start (batch sizes and the like); '' for nothing."""
        return ""

    def __init__(self, policy: Policy, config: ConfigT, context: Context):
        self.policy = policy
        self.config = config
        self.context = context

    def learn(self, segment: TensorDict, iteration: int) -> dict[str, float]:
        """One iteration's learning; returns scalars for metrics.jsonl (the first trainer's are logged). The segment
        (its layout: docs/plugins.md "Segments") is a copy the algorithm may keep across iterations.

        `iteration` counts from 0 (the first iteration is 0, the last context.num_iterations - 1), as metrics.jsonl's
        `iteration`, the checkpoints' iter_N and the console do; a resumed run continues with the iteration after
        its checkpoint's."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """Everything beyond the policy's weights needed to continue exactly (optimizers, critics, ...)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        """Release files (replay shards); called once at the end, and on the way out after an error (should close
        raise then too, the run's error line still names the first error)."""


class Callback:
    """Called on every trainer rank after every iteration. `metrics` is that iteration's record: on the first
    trainer (global rank 0) the whole metrics.jsonl line (episode returns, timings, evaluation results when
    `eval.every` asks); elsewhere iteration, env_steps and the algorithm's own scalars. Return scalars to add to
    metrics.jsonl and TensorBoard (the first trainer's are logged), or None."""

    Config: ClassVar[type] = NoConfig

    def __init__(self, config: Any, context: Context) -> None:
        self.config = config
        self.context = context

    def on_iteration_end(
        self, iteration: int, metrics: dict[str, Any], algorithm: Algorithm[Any]
    ) -> dict[str, float] | None:
        return None
