"""Observation encoders for the built-in actor-critic: the seam between what the env gives and the MLP heads.

Chosen from the observation space (policy.encoder: auto): a 1-D (or flattened) Box goes through a running
normalizer, an image Box (H x W x C or C x H x W, C in 1..4, uint8 scaled to [0, 1]) through a small CNN, and a Dict
space through one encoder per key, concatenated. Each encoder reports its output width.
"""

from __future__ import annotations

import math

import gymnasium as gym
import numpy as np
import torch
from tensordict import TensorDict
from torch import Tensor, nn

from spmd_rl.modules.normalizer import RunningNormalizer
from spmd_rl.runtime.errors import UserError


class VectorEncoder(nn.Module):
    """Flattened observations, optionally normalized with running statistics (merged across trainers)."""

    def __init__(self, space: gym.spaces.Box, normalize: bool):
        super().__init__()
        self.out_features = int(np.prod(space.shape)) if space.shape else 1
        self.normalizer = RunningNormalizer((self.out_features,), enabled=normalize)

    def forward(self, obs: Tensor) -> Tensor:
        if obs.dim() != 2:  # a multi-dimensional Box; vectors skip the reshape (this runs once per env step)
            obs = obs.reshape(obs.shape[0], self.out_features)
        obs = obs.to(torch.float32)
        # Without normalization, skip the normalizer's module call too (a few us of hook checks per env step).
        return self.normalizer(obs) if self.normalizer.enabled else obs

    def update_normalizer(self, obs: Tensor, context) -> None:
        # The statistics of what the network sees: float32, as forward() casts (a float64 env's raw values gave
        # statistics ~1e-7 apart, enough to send a MuJoCo run down another trajectory than before wave 2).
        obs = obs.reshape(obs.shape[0], self.out_features).to(torch.float32)
        context.merge_normalizer(self.normalizer, obs)


class ImageEncoder(nn.Module):
    """A small CNN over images: 3x3 convolutions (the first with stride 1, the rest stride 2), ReLU, then a linear
    layer. Channel-last images (as envs usually give them) are moved to channel-first; uint8 pixels scale to [0, 1]."""

    def __init__(self, space: gym.spaces.Box, channels: list[int], features: int):
        super().__init__()
        shape = tuple(space.shape)
        if len(shape) == 2:
            shape = (*shape, 1)
        self.channel_last = shape[-1] <= 4 and shape[0] > 4
        c, h, w = (shape[2], shape[0], shape[1]) if self.channel_last else shape
        self.image_shape = (c, h, w)
        self.scale = 1.0 / 255.0 if space.dtype == np.uint8 else 1.0
        layers: list[nn.Module] = []
        in_channels = c
        for i, out_channels in enumerate(channels):
            layers += [nn.Conv2d(in_channels, out_channels, 3, stride=1 if i == 0 else 2, padding=1), nn.ReLU()]
            in_channels = out_channels
        self.conv = nn.Sequential(*layers, nn.Flatten())
        with torch.no_grad():
            flat = self.conv(torch.zeros(1, c, h, w)).shape[-1]
        self.linear = nn.Sequential(nn.Linear(flat, features), nn.ReLU())
        self.out_features = features

    def forward(self, obs: Tensor) -> Tensor:
        c, h, w = self.image_shape
        x = obs.reshape(obs.shape[0], *((h, w, c) if self.channel_last else (c, h, w)))
        if self.channel_last:
            x = x.permute(0, 3, 1, 2)
        # A permuted single-channel image already counts as contiguous; without an explicit copy the convolution's
        # weight gradients come out channels-last, which DDP's gradient buckets warn about (and copy every step).
        x = x.to(torch.float32, memory_format=torch.contiguous_format) * self.scale
        return self.linear(self.conv(x))

    def update_normalizer(self, obs: Tensor, context) -> None:
        pass


class DictEncoder(nn.Module):
    """One encoder per key of a Dict space; their features concatenated in the space's key order."""

    def __init__(self, space: gym.spaces.Dict, config):
        super().__init__()
        self.encoders = nn.ModuleDict({key: make_encoder(sub, config) for key, sub in space.spaces.items()})
        self.out_features = sum(e.out_features for e in self.encoders.values())

    def forward(self, obs: TensorDict) -> Tensor:
        return torch.cat([encoder(obs[key]) for key, encoder in self.encoders.items()], dim=-1)

    def update_normalizer(self, obs: TensorDict, context) -> None:
        for key, encoder in self.encoders.items():
            encoder.update_normalizer(obs[key], context)


def is_image(space: gym.Space) -> bool:
    return (
        isinstance(space, gym.spaces.Box)
        and len(space.shape) in (2, 3)
        and (space.dtype == np.uint8 or min(space.shape) <= 4)
        and math.prod(space.shape) >= 64
    )


def make_encoder(space: gym.Space, config) -> nn.Module:
    """config: ActorCriticConfig (encoder, normalize_obs, cnn_channels, cnn_features)."""
    if isinstance(space, gym.spaces.Dict):
        return DictEncoder(space, config)
    if not isinstance(space, gym.spaces.Box):
        raise UserError(
            f"observation space {space} is not supported by the built-in actor-critic (Box, Dict of "
            f"Box); wrap the env (e.g. gymnasium's FlattenObservation) or bring your own policy.class"
        )
    choice = config.encoder
    if choice == "auto":
        choice = "cnn" if is_image(space) else "mlp"
    if choice == "cnn":
        if len(space.shape) not in (2, 3):
            raise UserError(f"policy.encoder=cnn needs image observations (H x W x C or C x H x W); got {space}")
        return ImageEncoder(space, list(config.cnn_channels), config.cnn_features)
    return VectorEncoder(space, config.normalize_obs)
