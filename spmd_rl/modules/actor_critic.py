"""The built-in actor-critic policy (`policy.class: actor_critic`): an observation encoder (modules/encoders.py),
then separate actor and critic MLPs (SB3 / CleanRL style) over its features.

Discrete actions use a categorical distribution over the actor's logits; Box actions a diagonal Gaussian whose
log std is a state-independent parameter. The distributions are written out (log-softmax, Gaussian log density)
rather than built as torch.distributions objects: this runs once per env step on inference ranks and once per
minibatch on trainers, and constructing distribution objects costs more than the math.
"""

from __future__ import annotations

import math

import gymnasium as gym
import torch
from torch import Tensor, nn

from spmd_rl.interfaces.policy import Policy, StepField
from spmd_rl.modules.configs import ActorCriticConfig
from spmd_rl.modules.encoders import make_encoder
from spmd_rl.runtime.errors import UserError

ACTIVATIONS = {"tanh": nn.Tanh, "relu": nn.ReLU, "elu": nn.ELU}
LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


def _layer(in_features: int, out_features: int, gain: float) -> nn.Linear:
    layer = nn.Linear(in_features, out_features)
    nn.init.orthogonal_(layer.weight, gain)
    nn.init.zeros_(layer.bias)
    return layer


def mlp(
    in_features: int, hidden_sizes: list[int], out_features: int, activation: str, head_gain: float
) -> nn.Sequential:
    """Hidden layers with orthogonal init (gain sqrt(2)), then a linear head with its own gain."""
    layers: list[nn.Module] = []
    for width in hidden_sizes:
        layers += [_layer(in_features, width, math.sqrt(2)), ACTIVATIONS[activation]()]
        in_features = width
    layers.append(_layer(in_features, out_features, head_gain))
    return nn.Sequential(*layers)


def _check_action_space(action_space: gym.Space) -> None:
    supported = "Discrete (start 0) or a 1-D Box"
    if isinstance(action_space, gym.spaces.Discrete):
        if int(action_space.start) != 0:
            raise UserError(f"action space {action_space} is not supported by the actor-critic ({supported})")
        return
    if not (isinstance(action_space, gym.spaces.Box) and len(action_space.shape) == 1):
        raise UserError(
            f"action space {action_space} is not supported by the actor-critic ({supported}); "
            f"wrap the env or bring your own policy.class"
        )


class ActorCritic(Policy):
    """Actor and critic MLPs over encoded observations; `forward(obs, action)` is `evaluate` so DDP can wrap it.

    Its outputs per step: the action, its log-prob and the critic's value (what PPO needs from a rollout)."""

    Config = ActorCriticConfig

    def __init__(self, observation_space: gym.Space, action_space: gym.Space, config: ActorCriticConfig):
        super().__init__(observation_space, action_space, config)
        _check_action_space(action_space)
        self.discrete = isinstance(action_space, gym.spaces.Discrete)
        if self.discrete:
            self.action_field = StepField((), torch.int64)
            actor_out = int(action_space.n)
        else:
            self.action_field = StepField((int(action_space.shape[0]),), torch.float32)
            actor_out = self.action_field.shape[0]
            self.log_std = nn.Parameter(torch.full((actor_out,), float(config.log_std_init)))
        self.encoder = make_encoder(observation_space, config)
        hidden, activation = list(config.hidden_sizes), config.activation
        self.actor = mlp(self.encoder.out_features, hidden, actor_out, activation, head_gain=0.01)
        self.critic = mlp(self.encoder.out_features, hidden, 1, activation, head_gain=1.0)

    def outputs(self) -> dict[str, StepField]:
        return {
            "action": self.action_field,
            "log_prob": StepField((), torch.float32),
            "value": StepField((), torch.float32),
        }

    def update_normalizer(self, obs, context) -> None:
        self.encoder.update_normalizer(obs, context)

    def value(self, obs) -> Tensor:
        """V(obs), shape [B]."""
        return self.critic(self.encoder(obs)).squeeze(-1)

    def act(self, obs, deterministic: bool = False) -> dict[str, Tensor]:
        """Sample actions (the mode when deterministic) with their log-probs and values. Continuous actions are
        unclipped; the env side clips. Every caller runs it under torch.no_grad() (the API's promise), so it adds
        no grad context of its own: this runs once per env step."""
        x = self.encoder(obs)
        out = self.actor(x)
        if self.discrete:
            log_probs = torch.log_softmax(out, dim=-1)
            if deterministic:
                action = log_probs.argmax(-1)
            else:
                action = torch.multinomial(log_probs.exp(), 1).squeeze(-1)
            log_prob = log_probs.gather(-1, action.unsqueeze(-1)).squeeze(-1)
        else:
            action = out if deterministic else out + self.log_std.exp() * torch.randn_like(out)
            log_prob = self._gaussian_log_prob(out, action)
        return {"action": action, "log_prob": log_prob, "value": self.critic(x).squeeze(-1)}

    def evaluate(self, obs, action: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(log_prob, entropy, value) of given actions, with gradients."""
        x = self.encoder(obs)
        out = self.actor(x)
        if self.discrete:
            log_probs = torch.log_softmax(out, dim=-1)
            # nll_loss picks each row's log-prob in one op (and one cheap backward) instead of gather + reshapes
            log_prob = -nn.functional.nll_loss(log_probs, action.long(), reduction="none")
            entropy = -(log_probs.exp() * log_probs).sum(-1)
        else:
            log_prob = self._gaussian_log_prob(out, action)
            entropy = (0.5 + LOG_SQRT_2PI + self.log_std).sum().expand(out.shape[0])
        return log_prob, entropy, self.critic(x).squeeze(-1)

    def forward(self, obs, action: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        # DDP only hooks forward(): the trainer calls ddp_policy(obs, action) to get evaluate() with synced grads.
        return self.evaluate(obs, action)

    def _gaussian_log_prob(self, mean: Tensor, action: Tensor) -> Tensor:
        z = (action - mean) * torch.exp(-self.log_std)
        return (-0.5 * z.square() - self.log_std - LOG_SQRT_2PI).sum(-1)
