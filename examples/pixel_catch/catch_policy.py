"""A user's own CNN policy for pixel Catch (`policy.class: catch_policy:CatchCNN`), written against spmd_rl.api.

One convolutional trunk shared by an actor head (logits over the discrete actions) and a critic head (the state
value). What PPO needs from a policy (`CategoricalActorCritic`, which frozen_policy.py's policy builds on too):
per-step outputs action, log_prob and value; `evaluate(obs, action)` with gradients (also as `forward`, the only
method DDP hooks); `value(obs)`.
"""

from dataclasses import dataclass

import gymnasium as gym
import numpy as np
import torch
from torch import Tensor, nn

from spmd_rl.api import Policy, StepField, UserError, knob


@dataclass
class CatchCNNConfig:
    channels: list[int] = knob(
        None, "output channels of each 3x3 convolution (stride 1, same padding)", factory=lambda: [16, 32], item_min=1
    )
    hidden: int = knob(128, "width of the linear layer between the convolutions and the heads", min=1)


class CategoricalActorCritic(Policy):
    """What PPO needs from a policy over discrete actions, from a subclass's `features(obs)` and its two heads on
    them: `self.actor` (logits over the actions) and `self.critic` (the state value). Catch's frames only: uint8
    images (height x width x channels) in, a Discrete action out."""

    actor: nn.Module
    critic: nn.Module

    def __init__(self, observation_space: gym.Space, action_space: gym.Space, config):
        super().__init__(observation_space, action_space, config)
        name = type(self).__name__
        if not (
            isinstance(observation_space, gym.spaces.Box)
            and len(observation_space.shape) == 3
            and observation_space.dtype == np.uint8
        ):
            raise UserError(f"{name} needs uint8 images (height x width x channels), got {observation_space}")
        if not isinstance(action_space, gym.spaces.Discrete):
            raise UserError(f"{name} needs a Discrete action space, got {action_space}")

    def outputs(self) -> dict[str, StepField]:
        return {
            "action": StepField((), torch.int64),
            "log_prob": StepField((), torch.float32),
            "value": StepField((), torch.float32),
        }

    def features(self, obs: Tensor) -> Tensor:
        raise NotImplementedError

    @torch.no_grad()
    def act(self, obs: Tensor, deterministic: bool = False) -> dict[str, Tensor]:
        x = self.features(obs)
        log_probs = torch.log_softmax(self.actor(x), dim=-1)
        action = log_probs.argmax(-1) if deterministic else torch.multinomial(log_probs.exp(), 1).squeeze(-1)
        return {
            "action": action,
            "log_prob": log_probs.gather(-1, action.unsqueeze(-1)).squeeze(-1),
            "value": self.critic(x).squeeze(-1),
        }

    def evaluate(self, obs: Tensor, action: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(log_prob, entropy, value) of the given actions, with gradients."""
        x = self.features(obs)
        log_probs = torch.log_softmax(self.actor(x), dim=-1)
        log_prob = log_probs.gather(-1, action.long().unsqueeze(-1)).squeeze(-1)
        entropy = -(log_probs.exp() * log_probs).sum(-1)
        return log_prob, entropy, self.critic(x).squeeze(-1)

    def forward(self, obs: Tensor, action: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return self.evaluate(obs, action)

    def value(self, obs: Tensor) -> Tensor:
        return self.critic(self.features(obs)).squeeze(-1)


class CatchCNN(CategoricalActorCritic):
    Config = CatchCNNConfig

    def __init__(self, observation_space: gym.Space, action_space: gym.Space, config: CatchCNNConfig):
        super().__init__(observation_space, action_space, config)  # checks the spaces
        height, width, channels = observation_space.shape
        layers: list[nn.Module] = []
        for out_channels in config.channels:
            layers += [nn.Conv2d(channels, out_channels, 3, padding=1), nn.ReLU()]
            channels = out_channels
        self.trunk = nn.Sequential(
            *layers, nn.Flatten(), nn.Linear(channels * height * width, config.hidden), nn.ReLU()
        )
        self.actor = nn.Linear(config.hidden, int(action_space.n))
        self.critic = nn.Linear(config.hidden, 1)
        # Near-uniform first actions: a small actor head (as in PPO's usual initialisation).
        nn.init.orthogonal_(self.actor.weight, 0.01)
        nn.init.zeros_(self.actor.bias)

    def features(self, obs: Tensor) -> Tensor:
        # [B, H, W, C] uint8 as the env gives it -> [B, C, H, W] floats in [0, 1], in plain (channels-first)
        # memory: a channels-last input makes the convolutions' weight gradients channels-last too, which DDP's
        # gradient buckets do not expect. (.contiguous() would not copy: with C = 1 both layouts count as it.)
        x = obs.permute(0, 3, 1, 2).to(torch.float32, memory_format=torch.contiguous_format)
        return self.trunk(x / 255.0)
