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

from spmd_rl.interfaces.policy import Policy, StepField
from spmd_rl.modules.configs import DeterministicActorConfig
from spmd_rl.modules.normalizer import RunningNormalizer
from spmd_rl.modules.sac_networks import check_sac_spaces, sac_mlp


class DeterministicActor(Policy):
    """mu(s) = action_scale * tanh(net(s)) + action_bias over normalized observations.

    `forward(obs)` is mu(s) in env units, with gradients (TD3's actor loss and, on the target copy, its TD
    target); `features(obs)` the observations as the critics see them; `act(obs)` mu(s) plus exploration noise.
    Its only per-step output is the action."""

    Config = DeterministicActorConfig

    def __init__(self, obs_space: gym.Space, action_space: gym.Space, config: DeterministicActorConfig):
        super().__init__(obs_space, action_space, config)
        check_sac_spaces(obs_space, action_space, who="TD3")
        obs_size, act_dim = int(obs_space.shape[0]), int(action_space.shape[0])
        self.obs_normalizer = RunningNormalizer((obs_size,), enabled=config.normalize_obs)
        self.net = sac_mlp(obs_size, list(config.hidden_sizes), act_dim, config.activation)
        low = torch.as_tensor(action_space.low, dtype=torch.float32)
        high = torch.as_tensor(action_space.high, dtype=torch.float32)
        self.register_buffer("action_scale", (high - low) / 2)
        self.register_buffer("action_bias", (high + low) / 2)
        self.exploration_noise = config.exploration_noise

    def features(self, obs: Tensor) -> Tensor:
        """Observations as the networks see them: float32, normalized when policy.normalize_obs."""
        return self.obs_normalizer(obs.to(torch.float32))

    def scaled(self, obs: Tensor) -> Tensor:
        """mu(s) in [-1, 1] (before the rescaling to the bounds), [B, act_dim]."""
        return torch.tanh(self.net(self.features(obs)))

    def forward(self, obs: Tensor) -> Tensor:
        """mu(s) in env units, [B, act_dim], with gradients."""
        return self.scaled(obs) * self.action_scale + self.action_bias

    def outputs(self) -> dict[str, StepField]:
        return {"action": StepField(tuple(self.action_scale.shape), torch.float32)}

    def update_normalizer(self, obs: Tensor, context) -> None:
        context.merge_normalizer(self.obs_normalizer, obs)

    @torch.no_grad()
    def act(self, obs: Tensor, deterministic: bool = False) -> dict[str, Tensor]:
        """mu(s), plus N(0, exploration_noise) per dimension in [-1, 1] units, clipped, unless deterministic."""
        action = self.scaled(obs)
        if not deterministic and self.exploration_noise > 0:
            action = (action + self.exploration_noise * torch.randn_like(action)).clamp(-1.0, 1.0)
        return {"action": action * self.action_scale + self.action_bias}
