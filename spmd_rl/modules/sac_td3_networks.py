"""SAC's and TD3's networks: the bounded actor both actors build on (TD3's deterministic one is in
deterministic_actor.py), SAC's tanh-squashed Gaussian actor (Haarnoja et al. 2018, as CleanRL's
sac_continuous_action), and the twin Q critics both learn, all of the MLPs of mlp.py.

The actor maps an observation to the mean and log std of a Gaussian over pre-squash actions u; the action is
tanh(u) rescaled to the action space's bounds, so every sampled action is valid without clipping. Its log-prob is
the Gaussian's minus the log-determinant of that change of variables. As in ActorCritic the densities are written
out rather than built as torch.distributions objects: this runs once per env step on inference ranks and several
times per gradient step on trainers.

Layers keep PyTorch's default initialization, as CleanRL's and SB3's SAC do (PPO's orthogonal init is not what
the SAC baselines use).
"""

from __future__ import annotations

import math

import gymnasium as gym
import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from spmd_rl.interfaces.policy import Policy, StepField
from spmd_rl.modules.configs import SquashedGaussianConfig
from spmd_rl.modules.distributions import LOG_SQRT_2PI
from spmd_rl.modules.mlp import mlp
from spmd_rl.modules.normalizer import RunningNormalizer
from spmd_rl.runtime.errors import UserError

# The log std is squashed into [LOG_STD_MIN, LOG_STD_MAX] with a tanh rather than clamped, so it keeps a gradient.
LOG_STD_MIN = -5.0
LOG_STD_MAX = 2.0
LOG_2 = math.log(2.0)


def check_sac_spaces(
    obs_space: gym.Space, action_space: gym.Space, who: str = "SAC"
) -> tuple[gym.spaces.Box, gym.spaces.Box]:
    """SAC's (and TD3's) MLPs need a 1-D Box of observations and a 1-D Box of actions with finite bounds: the two
    spaces, as Boxes."""
    if not isinstance(action_space, gym.spaces.Box):
        raise UserError(
            f"{who} needs continuous (Box) actions; got {action_space}: use algo.class=ppo for discrete actions"
        )
    if len(action_space.shape) != 1:
        raise UserError(
            f"{who} needs a 1-D Box of actions; got {action_space}: flatten it with a gymnasium action wrapper"
        )
    if not (np.isfinite(action_space.low).all() and np.isfinite(action_space.high).all()):
        raise UserError(
            f"{who} squashes actions into the action space's bounds, but {action_space} has infinite "
            "bounds; wrap the env so its Box has finite low and high"
        )
    if not (isinstance(obs_space, gym.spaces.Box) and len(obs_space.shape) == 1):
        raise UserError(
            f"observation space {obs_space} is not supported by {who}'s MLPs (a 1-D Box is); flatten "
            "it with a gymnasium wrapper such as FlattenObservation"
        )
    return obs_space, action_space


class BoundedActor(Policy):
    """What SAC's and TD3's actors share: a 1-D Box observation normalized as the critics see it, and a Box
    action reached as action_scale * tanh(.) + action_bias. The subclass builds `net` (after this __init__, so the
    layout of parameters, buffers and checkpoints is the same for both) and acts."""

    action_scale: Tensor  # registered buffers
    action_bias: Tensor

    def __init__(self, obs_space: gym.Space, action_space: gym.Space, config, who: str):
        super().__init__(obs_space, action_space, config)
        obs_box, action_box = check_sac_spaces(obs_space, action_space, who=who)
        # Always present (fixed state layout for weight buckets and checkpoints); the critics see the same
        # normalized observations through `features`.
        self.obs_normalizer = RunningNormalizer((int(obs_box.shape[0]),), enabled=config.normalize_obs)
        low = torch.as_tensor(action_box.low, dtype=torch.float32)
        high = torch.as_tensor(action_box.high, dtype=torch.float32)
        self.register_buffer("action_scale", (high - low) / 2)
        self.register_buffer("action_bias", (high + low) / 2)

    def features(self, obs: Tensor) -> Tensor:
        """Observations as the networks see them: float32, normalized when policy.normalize_obs."""
        return self.obs_normalizer(obs.to(torch.float32))

    def outputs(self) -> dict[str, StepField]:
        return {"action": StepField(tuple(self.action_scale.shape), torch.float32)}

    def update_normalizer(self, obs: Tensor, context) -> None:
        context.merge_normalizer(self.obs_normalizer, obs)


class SquashedGaussianActor(BoundedActor):
    """pi(a|s): a Gaussian over u, squashed to a = action_scale * tanh(u) + action_bias, over normalized obs.

    `forward(obs)` gives the Gaussian's (mean, log_std); `sample(obs)` draws reparameterized actions with their
    log-probs (for the updates); `act(obs)` is the inference server's no-grad sampling. Its only per-step output
    is the action: SAC learns from (s, a, r, s') alone.
    """

    Config = SquashedGaussianConfig

    def __init__(self, obs_space: gym.Space, action_space: gym.Space, config: SquashedGaussianConfig):
        super().__init__(obs_space, action_space, config, who="SAC")
        # One head for mean and log std: a single matmul instead of two.
        act_dim = self.action_scale.shape[0]  # the Box's widths, as BoundedActor checked them
        self.net = mlp(
            self.obs_normalizer.shape[0], list(config.hidden_sizes), 2 * act_dim, config.activation, ortho_init=False
        )

    def forward(self, obs: Tensor) -> tuple[Tensor, Tensor]:
        """The pre-squash Gaussian's (mean, log_std), each [B, act_dim]."""
        mean, raw_log_std = self.net(self.features(obs)).chunk(2, dim=-1)
        log_std = LOG_STD_MIN + 0.5 * (LOG_STD_MAX - LOG_STD_MIN) * (torch.tanh(raw_log_std) + 1)
        return mean, log_std

    def sample(self, obs: Tensor) -> tuple[Tensor, Tensor]:
        """(action [B, act_dim] in env units, log_prob [B]) with the reparameterization trick: differentiable."""
        mean, log_std = self(obs)
        noise = torch.randn_like(mean)
        u = mean + log_std.exp() * noise
        # log N(u; mean, std), where (u - mean) / std is the noise itself.
        gaussian_log_prob = -0.5 * noise.square() - log_std - LOG_SQRT_2PI
        # Change of variables a = scale * tanh(u) + bias: log|da/du| = log scale + log(1 - tanh(u)^2), the second
        # term in the stable form 2 (log 2 - u - softplus(-2u)), which stays finite where tanh(u) rounds to +-1.
        log_det = self.action_scale.log() + 2 * (LOG_2 - u - F.softplus(-2 * u))
        action = torch.tanh(u) * self.action_scale + self.action_bias
        return action, (gaussian_log_prob - log_det).sum(-1)

    @torch.no_grad()
    def act(self, obs: Tensor, deterministic: bool = False) -> dict[str, Tensor]:
        """Actions for the inference server: sampled, or the squashed mean when deterministic."""
        if deterministic:
            mean, _ = self(obs)
            return {"action": torch.tanh(mean) * self.action_scale + self.action_bias}
        action, _ = self.sample(obs)
        return {"action": action}


class TwinQ(nn.Module):
    """Two independent Q(s, a) MLPs on concat(obs, action); SAC learns both and trusts the smaller.

    obs must already be normalized the way the actor sees it (SquashedGaussianActor.features): SAC does that, so
    the actor's normalizer is the only one.
    """

    def __init__(self, obs_space: gym.Space, action_space: gym.Space, hidden: list[int], activation: str):
        super().__init__()
        obs_box, action_box = check_sac_spaces(obs_space, action_space)
        in_features = int(obs_box.shape[0]) + int(action_box.shape[0])
        self.q1 = mlp(in_features, hidden, 1, activation, ortho_init=False)
        self.q2 = mlp(in_features, hidden, 1, activation, ortho_init=False)

    def forward(self, obs: Tensor, action: Tensor) -> tuple[Tensor, Tensor]:
        """(q1, q2), each [B]."""
        x = torch.cat([obs, action], dim=-1)
        return self.q1(x).squeeze(-1), self.q2(x).squeeze(-1)

    def q1_value(self, obs: Tensor, action: Tensor) -> Tensor:
        """q1 of forward, [B], without computing q2 (TD3's actor climbs q1 alone)."""
        return self.q1(torch.cat([obs, action], dim=-1)).squeeze(-1)
