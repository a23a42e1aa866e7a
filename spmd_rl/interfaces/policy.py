"""The Policy contract: a torch module that acts, and the per-step fields every segment carries."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import gymnasium as gym
import torch
from torch import Tensor, nn

from spmd_rl.config.sections import NoConfig

if TYPE_CHECKING:  # annotations only: importing tensordict costs seconds (torch._dynamo), and a user's module
    from tensordict import TensorDict  # imports this one to answer --help and config errors

    from spmd_rl.interfaces.context import Context


@dataclass(frozen=True)
class StepField:
    """One per-step value for one env: its shape (without the env dimension) and dtype. As part of a recurrent
    state (`Policy.recurrent_state`), `initial` is the value every element starts from, and returns to at each
    episode start."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    initial: float = 0.0


# What the env side records for every step, besides the observation and the policy's outputs.
ENV_FIELDS = {
    "reward": StepField((), torch.float32),
    "terminated": StepField((), torch.bool),
    "truncated": StepField((), torch.bool),
    "valid": StepField((), torch.bool),
    "episode_return": StepField((), torch.float32),
    "episode_length": StepField((), torch.int64),
    "episode_done": StepField((), torch.bool),
}

# What the env side records besides ENV_FIELDS for an env that reports a success flag (env.success_key,
# envs/success.py), at the step that ends an episode: whether it succeeded at any of its steps, and at its last.
SUCCESS_FIELDS = {
    "episode_success": StepField((), torch.bool),
    "episode_success_at_end": StepField((), torch.bool),
}
# With env.action_chunk K > 1, the rollout's "reward" is [T, N, K] (each primitive step's reward, 0 past an early
# stop) and CHUNK_VALID [T, N, K] says which of the chunk's K steps ran (an episode's end stops a chunk early; a
# reset step runs none).
CHUNK_VALID = "chunk_valid"
# In rollouts of whole episodes, ACTIVE [T, N] is True while the env's episode, begun at the rollout's first step,
# has not ended: an env whose episode ended waits inactive (its steps are no part of the rollout) until the end.
ACTIVE = "active"

# What the env side records besides ENV_FIELDS for a recurrent policy: True where the step's observation is the
# first of an episode (the first step of the run, or the step after an episode's reset step), where the policy's
# state restarts from its initial value.
EPISODE_START = "episode_start"
# The segment's key for the recurrent state each env column entered the segment's first step with (before the
# reset at an episode start), {name: [N, *shape]}: where the learner starts its replay of the sequence.
RECURRENT_STATE = "recurrent_state"
# With env.groups, the experience files' column of each row's group index (int16; the names in the file's
# group_names attribute). Not part of what an algorithm learns from.
GROUP = "group"


class Policy(nn.Module):
    """A module that acts. Subclass it, set `Config` to a dataclass of your keys, and implement `outputs` and
    `act`. Add whatever your algorithm needs from it (PPO: `evaluate` and `value`; SAC: `sample` and `features`)."""

    Config: ClassVar[type] = NoConfig
    # How many policies this process constructed with real tensors (of any class; an instance built on the meta
    # device, which holds no data, is not counted): finished.json's policy_builds per rank, asserted by tests.
    real_constructions: ClassVar[int] = 0

    if TYPE_CHECKING:
        # For the type checker only: the methods an algorithm calls beyond this contract (PPO's evaluate, DQN's
        # q_values) are the policy's own, declared in the algorithm's policy_methods and checked before start, so
        # statically they are Any (nn.Module's own __getattr__, which finds parameters and submodules, is kept).
        def __getattr__(self, name: str) -> Any: ...

    def __init__(self, observation_space: gym.Space[Any], action_space: gym.Space[Any], config: Any):
        super().__init__()
        if torch.get_default_device().type != "meta":
            Policy.real_constructions += 1
        self.observation_space = observation_space
        self.action_space = action_space
        self.config = config

    def outputs(self) -> dict[str, StepField]:
        """The per-step fields `act` returns, "action" first; each reaches the trainer in every rollout."""
        raise NotImplementedError

    def act(self, obs: Tensor | TensorDict, deterministic: bool = False) -> dict[str, Tensor]:
        """Actions (and the other declared outputs) for a batch of observations [B, ...]; called without grad.

        A recurrent policy (one whose `recurrent_state()` is not None) is called as `act(obs, deterministic,
        state=state)` with `state` {name: [B, *shape]} (already reset to its initial value where an episode starts)
        and returns `(outputs, next_state)`, next_state laid out like state."""
        raise NotImplementedError

    def recurrent_state(self) -> dict[str, StepField] | None:
        """None for a stateless policy (the default: the framework then does no per-step work for it). A recurrent
        policy returns the state it carries from one step to the next, per env: {name: StepField(shape, dtype,
        initial)}. The framework keeps it where acting happens (outside the module: it never ships with the
        weights), resets it to `initial` at every episode start, saves it in checkpoints, and hands the learner
        each segment's starting state (segment["recurrent_state"]) and the episode starts
        (rollout["episode_start"])."""
        return None

    def file_sources(self) -> dict[str, tuple[Path, str]]:
        """Where tensors of this policy's state_dict come from in safetensors files, {name: (file, name there)}, as
        modules.pretrained.load_weights returns it for the module it loads (the default: none). Sharded trainers
        (train.parallel=fsdp) then each read only their own rows of those, and trainer 0 builds the policy without
        reading them (load_weights within modules.pretrained.reading_deferred()); the rest comes from trainer 0."""
        return {}

    def file_state(self) -> dict[str, Tensor]:
        """What policy.pt holds: the state_dict (the default). A policy may write another layout (the vla policy's
        LoRA adapters merged into its weights, or the adapters alone) that `from_file_state` reads back;
        checkpoints always hold the state_dict."""
        return self.state_dict()

    def from_file_state(self, state: dict[str, Tensor]) -> dict[str, Tensor]:
        """A policy file's tensors (policy.pt as `file_state` wrote it, or a checkpoint's state_dict) in this
        policy's state_dict layout, which the loader then checks key by key (the default: as they are)."""
        return state

    def update_normalizer(self, obs: Tensor | TensorDict, context: Context) -> None:
        """Fold a batch of observations into running statistics the policy holds (merged across trainers with
        `context.merge_normalizer`). Algorithms call it; the default holds no statistics."""


def describe_outputs(outputs: dict[str, StepField]) -> str:
    return ", ".join(f"{k} {tuple(f.shape)} {str(f.dtype).replace('torch.', '')}" for k, f in outputs.items())


def initial_state(
    fields: dict[str, StepField], batch: int, device: torch.device | str | None = None
) -> dict[str, Tensor]:
    """A recurrent state's initial value for `batch` envs: {name: [batch, *shape]} filled with each `initial`."""
    return {name: torch.full((batch, *f.shape), f.initial, dtype=f.dtype, device=device) for name, f in fields.items()}
