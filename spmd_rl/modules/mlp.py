"""The MLP every built-in network is made of (the actor-critics', SAC's and TD3's actors and critics, DQN's Q-network
head): hidden layers with an activation, then a linear head."""

from __future__ import annotations

import math

from torch import nn

ACTIVATIONS = {"tanh": nn.Tanh, "relu": nn.ReLU, "elu": nn.ELU}


def _layer(in_features: int, out_features: int, gain: float | None) -> nn.Linear:
    layer = nn.Linear(in_features, out_features)
    if gain is not None:  # None: nn.Linear's own initialization, as it is
        nn.init.orthogonal_(layer.weight, gain)
        nn.init.zeros_(layer.bias)
    return layer


def mlp(
    in_features: int,
    hidden_sizes: list[int],
    out_features: int,
    activation: str,
    head_gain: float = 1.0,
    ortho_init: bool = True,
) -> nn.Sequential:
    """Hidden layers with orthogonal init (gain sqrt(2)), then a linear head with its own gain; without ortho_init,
    torch's default initialization for all of them (SB3's ortho_init=False)."""
    layers: list[nn.Module] = []
    for width in hidden_sizes:
        layers += [_layer(in_features, width, math.sqrt(2) if ortho_init else None), ACTIVATIONS[activation]()]
        in_features = width
    layers.append(_layer(in_features, out_features, head_gain if ortho_init else None))
    return nn.Sequential(*layers)
