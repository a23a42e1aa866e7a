"""Observation encoders for the built-in actor-critic: the seam between what the env gives and the MLP heads.

Chosen from the observation space (policy.encoder: auto): a 1-D (or flattened) Box goes through a running
normalizer, an image Box (H x W x C or C x H x W, C in 1..4, uint8 scaled to [0, 1]) through a CNN (preset
small or nature, see CNN_PRESETS), a text (token ids, envs/text.py) through an embedding and a mean over its
tokens, and a Dict space through one encoder per key, concatenated. Each encoder reports its output width.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, cast

import gymnasium as gym
import numpy as np
import torch
from tensordict import TensorDict
from torch import Tensor, nn

from spmd_rl.envs.text import TokenizedText
from spmd_rl.modules.masks import MASK_KEY
from spmd_rl.modules.normalizer import RunningNormalizer
from spmd_rl.runtime.errors import UserError


class Encoder(nn.Module):
    """What the heads build on: an encoder's feature width, and the running statistics it may hold."""

    out_features: int

    def update_normalizer(self, obs, context) -> None:
        raise NotImplementedError


class VectorEncoder(Encoder):
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


@dataclass(frozen=True)
class ConvLayer:
    channels: int
    kernel: int
    stride: int
    padding: int


# Each preset's layers for a given channel list: small pads "same" and halves the size after its first layer, as the
# encoder always did; nature is the DQN paper's fixed three-layer stack for 84x84 frames.
CNN_PRESETS: dict[str, dict[str, Any]] = {
    "small": {
        "channels": [16, 32],
        "kernels": lambda n: [3] * n,
        "strides": lambda n: [1] + [2] * (n - 1),
        "features": 256,
    },
    "nature": {
        "channels": [32, 64, 64],
        "kernels": lambda n: [8, 4, 3],
        "strides": lambda n: [4, 2, 1],
        "features": 512,
    },
}


def cnn_layers(config) -> tuple[list[ConvLayer], int]:
    """The conv layers and the feature width that policy.cnn and the cnn_* keys describe (an empty list or 0 takes
    the preset's)."""
    preset = CNN_PRESETS[config.cnn]
    channels = list(config.cnn_channels) or preset["channels"]
    n = len(channels)
    kernels = list(config.cnn_kernels) or preset["kernels"](n)
    strides = list(config.cnn_strides) or preset["strides"](n)
    if not len(kernels) == len(strides) == n:
        raise UserError(
            f"policy.cnn_channels ({n} layers), policy.cnn_kernels ({len(kernels)}) and policy.cnn_strides "
            f"({len(strides)}) must give one value per conv layer (policy.cnn={config.cnn}); set all three"
        )
    pad = config.cnn == "small"
    layers = [ConvLayer(c, k, s, k // 2 if pad else 0) for c, k, s in zip(channels, kernels, strides)]
    return layers, config.cnn_features or preset["features"]


def image_layout(space: gym.spaces.Box) -> tuple[bool, tuple[int, int, int], float]:
    """(channel_last, (C, H, W), scale) of an image space: a 2-D image has one channel; an image whose last axis
    is 1-4 wide and whose first is not is channel-last (as envs usually give them); uint8 pixels scale to [0, 1]."""
    shape = tuple(space.shape)
    if len(shape) == 2:
        shape = (*shape, 1)
    channel_last = shape[-1] <= 4 and shape[0] > 4
    c, h, w = (shape[2], shape[0], shape[1]) if channel_last else shape
    return channel_last, (c, h, w), 1.0 / 255.0 if space.dtype == np.uint8 else 1.0


def image_batch(obs: Tensor, channel_last: bool, image_shape: tuple[int, int, int], scale: float) -> Tensor:
    """A batch of images as the env gives them -> [B, C, H, W] float32 in plain (channel-first) memory, scaled."""
    c, h, w = image_shape
    x = obs.reshape(obs.shape[0], *((h, w, c) if channel_last else (c, h, w)))
    if channel_last:
        x = x.permute(0, 3, 1, 2)
    # A permuted single-channel image already counts as contiguous; without an explicit copy the convolution's
    # weight gradients come out channels-last, which DDP's gradient buckets warn about (and copy every step).
    x = x.to(torch.float32, memory_format=torch.contiguous_format)
    if scale != 1.0:  # uint8 pixels: `to` made a new tensor; scaling it in place spares a second float copy
        x.mul_(scale)  # of the batch (a 256-frame Breakout minibatch: ~14 ms instead of ~25 here)
    return x


class ImageEncoder(Encoder):
    """A CNN over images: conv layers with ReLU, then a linear layer with ReLU (see CNN_PRESETS). Channel-last images
    (as envs usually give them) are moved to channel-first. Pixels travel as uint8 (a quarter of float32's bytes on
    every channel and in the rollout) and become floats in [0, 1] here, inside the network."""

    def __init__(self, space: gym.spaces.Box, layers: list[ConvLayer], features: int, orthogonal_init: bool = False):
        super().__init__()
        self.channel_last, self.image_shape, self.scale = image_layout(space)
        c, h, w = self.image_shape
        modules: list[nn.Module] = []
        in_channels = c
        for layer in layers:
            conv = nn.Conv2d(in_channels, layer.channels, layer.kernel, stride=layer.stride, padding=layer.padding)
            modules += [conv, nn.ReLU()]
            in_channels = layer.channels
        self.conv = nn.Sequential(*modules, nn.Flatten())
        with torch.no_grad():
            try:
                flat = self.conv(torch.zeros(1, c, h, w)).shape[-1]
            except RuntimeError:  # a kernel larger than what is left of the image
                raise UserError(
                    f"the CNN encoder's layers (policy.cnn, cnn_kernels, cnn_strides) shrink a {h}x{w} image to "
                    f"nothing; use smaller kernels or strides, or policy.cnn=small"
                ) from None
        self.linear = nn.Sequential(nn.Linear(flat, features), nn.ReLU())
        if orthogonal_init:  # ReLU layers, as the heads' hidden layers are initialized (gain sqrt(2), zero bias)
            for module in self.modules():
                if isinstance(module, (nn.Conv2d, nn.Linear)):
                    nn.init.orthogonal_(module.weight, math.sqrt(2))
                    assert module.bias is not None  # built with their default bias
                    nn.init.zeros_(module.bias)
        self.out_features = features

    def forward(self, obs: Tensor) -> Tensor:
        return self.linear(self.conv(image_batch(obs, self.channel_last, self.image_shape, self.scale)))

    def update_normalizer(self, obs: Tensor, context) -> None:
        pass


class TextEncoder(Encoder):
    """Token ids (envs/text.py: ids and a mask, from a Text observation) through a learned embedding, then the mean
    over the tokens the mask marks: one feature vector per text, whatever its length."""

    def __init__(self, space: TokenizedText, width: int):
        super().__init__()
        self.embedding = nn.Embedding(space.vocab_size, width)
        self.out_features = width

    def forward(self, obs: TensorDict) -> Tensor:
        mask = obs["mask"].to(torch.float32).unsqueeze(-1)  # [B, L, 1]
        summed = (self.embedding(obs["ids"].long()) * mask).sum(1)
        return summed / mask.sum(1).clamp(min=1.0)  # an empty text gives zeros, not NaN

    def update_normalizer(self, obs: TensorDict, context) -> None:
        pass


class DictEncoder(Encoder):
    """One encoder per key of a Dict space (but `action_mask`); their features concatenated in the space's key
    order."""

    def __init__(self, space: gym.spaces.Dict, config):
        super().__init__()
        # An action mask (modules/masks.py) tells the policy which actions it may take; it is no input feature.
        inputs = {key: sub for key, sub in space.spaces.items() if key != MASK_KEY}
        encoders = {key: make_encoder(sub, config) for key, sub in inputs.items()}
        self.encoders = nn.ModuleDict(encoders)
        self.out_features = sum(e.out_features for e in encoders.values())

    def forward(self, obs: TensorDict) -> Tensor:
        return torch.cat([encoder(obs[key]) for key, encoder in self.encoders.items()], dim=-1)

    def update_normalizer(self, obs: TensorDict, context) -> None:
        for key, encoder in self.encoders.items():
            cast(Encoder, encoder).update_normalizer(obs[key], context)  # a ModuleDict's values are typed Module


def is_image(space: gym.Space) -> bool:
    return (
        isinstance(space, gym.spaces.Box)
        and len(space.shape) in (2, 3)
        and (space.dtype == np.uint8 or min(space.shape) <= 4)
        and math.prod(space.shape) >= 64
    )


def make_encoder(space: gym.Space, config) -> Encoder:
    """config: EncoderConfig (encoder, normalize_obs, cnn, cnn_channels, cnn_kernels, cnn_strides, cnn_features,
    cnn_init, text_embedding)."""
    if isinstance(space, TokenizedText):
        return TextEncoder(space, config.text_embedding)
    if isinstance(space, gym.spaces.Dict):
        return DictEncoder(space, config)
    if not isinstance(space, gym.spaces.Box):
        raise UserError(
            f"observation space {space} is not supported by the built-in actor-critic (Box, Text, Dict of "
            f"those); wrap the env (e.g. gymnasium's FlattenObservation) or bring your own policy.class"
        )
    choice = config.encoder
    if choice == "auto":
        choice = "cnn" if is_image(space) else "mlp"
    if choice == "cnn":
        if len(space.shape) not in (2, 3):
            raise UserError(f"policy.encoder=cnn needs image observations (H x W x C or C x H x W); got {space}")
        layers, features = cnn_layers(config)
        init = config.cnn_init if config.cnn_init != "auto" else ("orthogonal" if config.cnn == "nature" else "default")
        return ImageEncoder(space, layers, features, orthogonal_init=init == "orthogonal")
    return VectorEncoder(space, config.normalize_obs)
