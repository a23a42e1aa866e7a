"""TD3's actor (`policy.class: deterministic_actor`): an MLP whose tanh output, rescaled to the action space's
bounds, is the action. Acting (the inference server, not deterministic) adds Gaussian exploration noise of
policy.exploration_noise times the action's half-range and clips to the bounds, as SB3's TD3 adds its action noise
to actions scaled to [-1, 1]; evaluation acts deterministically, without noise.

Layers keep PyTorch's default initialization, as SB3's and CleanRL's TD3 do.
"""

from __future__ import annotations

import gymnasium as gym
import torch
from torch import Tensor

from spmd_rl.modules.configs import DeterministicActorConfig
from spmd_rl.modules.mlp import mlp
from spmd_rl.modules.sac_td3_networks import BoundedActor


class DeterministicActor(BoundedActor):
    """mu(s) = action_scale * tanh(net(s)) + action_bias over normalized observations.

    `forward(obs)` is mu(s) in env units, with gradients (TD3's actor loss and, on the target copy, its TD
    target); `features(obs)` the observations as the critics see them; `act(obs)` mu(s) plus exploration noise.
    Its only per-step output is the action."""

    Config = DeterministicActorConfig

    def __init__(self, obs_space: gym.Space, action_space: gym.Space, config: DeterministicActorConfig):
        super().__init__(obs_space, action_space, config, who="TD3")
        act_dim = self.action_scale.shape[0]  # the Box's widths, as BoundedActor checked them
        self.net = mlp(
            self.obs_normalizer.shape[0], list(config.hidden_sizes), act_dim, config.activation, ortho_init=False
        )
        self.exploration_noise = config.exploration_noise

    def scaled(self, obs: Tensor) -> Tensor:
        """mu(s) in [-1, 1] (before the rescaling to the bounds), [B, act_dim]."""
        return torch.tanh(self.net(self.features(obs)))

    def forward(self, obs: Tensor) -> Tensor:
        """mu(s) in env units, [B, act_dim], with gradients."""
        return self.scaled(obs) * self.action_scale + self.action_bias

    @torch.no_grad()
    def act(self, obs: Tensor, deterministic: bool = False) -> dict[str, Tensor]:
        """mu(s), plus N(0, exploration_noise) per dimension in [-1, 1] units, clipped, unless deterministic."""
        action = self.scaled(obs)
        if not deterministic and self.exploration_noise > 0:
            action = (action + self.exploration_noise * torch.randn_like(action)).clamp(-1.0, 1.0)
        return {"action": action * self.action_scale + self.action_bias}
