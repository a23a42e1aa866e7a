"""The Policy contract: a torch module that acts, and the per-step fields every segment carries."""

from __future__ import annotations

from dataclasses import dataclass
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
    """One per-step value for one env: its shape (without the env dimension) and dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype


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


class Policy(nn.Module):
    """A module that acts. Subclass it, set `Config` to a dataclass of your keys, and implement `outputs` and
    `act`. Add whatever your algorithm needs from it (PPO: `evaluate` and `value`; SAC: `sample` and `features`)."""

    Config: ClassVar[type] = NoConfig

    def __init__(self, observation_space: gym.Space, action_space: gym.Space, config: Any):
        super().__init__()
        self.observation_space = observation_space
        self.action_space = action_space
        self.config = config

    def outputs(self) -> dict[str, StepField]:
        """The per-step fields `act` returns, "action" first; each reaches the trainer in every rollout."""
        raise NotImplementedError

    def act(self, obs: Tensor | TensorDict, deterministic: bool = False) -> dict[str, Tensor]:
        """Actions (and the other declared outputs) for a batch of observations [B, ...]; called without grad."""
        raise NotImplementedError

    def update_normalizer(self, obs: Tensor | TensorDict, context: Context) -> None:
        """Fold a batch of observations into running statistics the policy holds (merged across trainers with
        `context.merge_normalizer`). Algorithms call it; the default holds no statistics."""


def describe_outputs(outputs: dict[str, StepField]) -> str:
    return ", ".join(f"{k} {tuple(f.shape)} {str(f.dtype).replace('torch.', '')}" for k, f in outputs.items())
