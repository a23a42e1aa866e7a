"""A user's policy with a frozen "pretrained" encoder and a trainable head (`policy.class:
frozen_policy:FrozenEncoderPolicy`), written against spmd_rl.api.

The encoder (`PixelEncoder`, two 3x3 convolutions and a linear layer) is loaded from a safetensors file that
make_encoder.py writes (`policy.encoder_file`), and frozen: its parameters have requires_grad=False, so they get no
gradient, DDP leaves them out of its gradient buckets, and Adam keeps no state for them. The head (an actor and a
critic MLP over the encoder's features) is all that learns. What PPO needs from a policy (per-step outputs action,
log_prob and value; `evaluate(obs, action)` with gradients, also as `forward`; `value(obs)`) comes from
catch_policy.py's `CategoricalActorCritic`, as for the CNN policy trained from scratch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import gymnasium as gym
import torch
from catch_policy import CategoricalActorCritic
from safetensors.torch import load_file
from torch import Tensor, nn

from spmd_rl.api import UserError, knob

FEATURES = 64  # the encoder's output width, fixed by its pretraining


class PixelEncoder(nn.Module):
    """uint8 frames [B, H, W, C] -> features [B, FEATURES]: the network make_encoder.py pretrains."""

    def __init__(self, height: int, width: int, channels: int):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(channels, 8, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(8, 16, 3, padding=1),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(16 * height * width, FEATURES),
            nn.ReLU(),
        )

    def forward(self, frames: Tensor) -> Tensor:
        # channels-first floats in [0, 1], in plain memory (a channels-last input gives channels-last gradients)
        x = frames.permute(0, 3, 1, 2).to(torch.float32, memory_format=torch.contiguous_format)
        return self.net(x / 255.0)


@dataclass
class FrozenEncoderConfig:
    encoder_file: str = knob(
        "encoder.safetensors", "the pretrained encoder's weights (safetensors; relative to the working directory)"
    )
    hidden: int = knob(64, "width of the hidden layer of the trainable actor and critic heads", min=1)


class FrozenEncoderPolicy(CategoricalActorCritic):
    Config = FrozenEncoderConfig

    def __init__(self, observation_space: gym.Space, action_space: gym.Space, config: FrozenEncoderConfig):
        super().__init__(observation_space, action_space, config)  # checks the spaces
        self.encoder = PixelEncoder(*observation_space.shape)
        if not os.path.isfile(config.encoder_file):
            raise UserError(
                f"policy.encoder_file '{config.encoder_file}' does not exist in {os.getcwd()}; write it with "
                f"`python make_encoder.py` (in this example's folder) or give its path"
            )
        try:
            self.encoder.load_state_dict(load_file(config.encoder_file))
        except RuntimeError as exc:  # missing or unexpected names, other shapes: an encoder for another frame size
            detail = " ".join(str(exc).split())[:300]  # one line
            raise UserError(
                f"policy.encoder_file '{config.encoder_file}' does not fit {observation_space}: {detail}"
            ) from None
        self.encoder.requires_grad_(False)
        actions = int(action_space.n)
        self.actor = nn.Sequential(nn.Linear(FEATURES, config.hidden), nn.Tanh(), nn.Linear(config.hidden, actions))
        self.critic = nn.Sequential(nn.Linear(FEATURES, config.hidden), nn.Tanh(), nn.Linear(config.hidden, 1))
        # near-uniform first actions: a small actor output layer (PPO's usual initialisation)
        nn.init.orthogonal_(self.actor[2].weight, 0.01)
        nn.init.zeros_(self.actor[2].bias)

    def features(self, obs: Tensor) -> Tensor:
        with torch.no_grad():  # frozen: no graph through the encoder, not even for the head's gradients
            return self.encoder(obs)
