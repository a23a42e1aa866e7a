"""DQN's Q-network (`policy.class: q_network`): the built-in observation encoder (modules/encoders.py), then an
MLP giving Q(s, a) for every discrete action. It is a Policy like any other, so inference ranks serve it: `act`
is epsilon-greedy, epsilon a buffer that the DQN trainer sets from its schedule and that travels with the weights.

The Q MLP keeps PyTorch's default initialization, as SB3's and CleanRL's DQN do; so does a CNN encoder under
`policy.cnn_init: default` (configs/dqn_atari.yaml), while `auto` keeps the nature preset's orthogonal init.
With an `action_mask` in the observation (modules/masks.py) the argmax and the random actions range over the
allowed actions only.
"""

from __future__ import annotations

import gymnasium as gym
import torch
from torch import Tensor

from spmd_rl.interfaces.policy import Policy, StepField
from spmd_rl.modules.configs import QNetworkConfig
from spmd_rl.modules.encoders import make_encoder
from spmd_rl.modules.masks import action_mask_of, masked
from spmd_rl.modules.mlp import mlp
from spmd_rl.runtime.errors import UserError


class QNetwork(Policy):
    """Q(s, .) over encoded observations; act: argmax (deterministic), else a uniform random action with
    probability `epsilon`, the argmax otherwise. Its only per-step output is the action."""

    Config = QNetworkConfig
    epsilon: Tensor  # a registered buffer

    def __init__(self, observation_space: gym.Space, action_space: gym.Space, config: QNetworkConfig):
        super().__init__(observation_space, action_space, config)
        if not (isinstance(action_space, gym.spaces.Discrete) and int(action_space.start) == 0):
            raise UserError(
                f"action space {action_space} is not supported by the Q-network (Discrete, start 0): DQN needs "
                "discrete actions; use algo.class=sac for continuous ones"
            )
        self.num_actions = int(action_space.n)
        self.encoder = make_encoder(observation_space, config)
        self.q = mlp(
            self.encoder.out_features, list(config.hidden_sizes), self.num_actions, config.activation, ortho_init=False
        )
        # Set by the trainer each iteration (DQN's schedule); a buffer, so weight syncs and checkpoints carry it.
        self.register_buffer("epsilon", torch.tensor(1.0))

    def q_values(self, obs) -> Tensor:
        """Q(s, a) for every action, [B, num_actions] (float32), with gradients; masked actions are not masked."""
        return self.q(self.encoder(obs)).float()

    def outputs(self) -> dict[str, StepField]:
        return {"action": StepField((), torch.int64)}

    def update_normalizer(self, obs, context) -> None:
        self.encoder.update_normalizer(obs, context)

    def act(self, obs, deterministic: bool = False) -> dict[str, Tensor]:
        mask = action_mask_of(obs)
        greedy = masked(self.q_values(obs), mask).argmax(-1)
        if deterministic:
            return {"action": greedy}
        # A uniform allowed action: the argmax of uniform noise over the allowed ones.
        noise = torch.rand(greedy.shape[0], self.num_actions, device=greedy.device)
        random = masked(noise, mask).argmax(-1)
        explore = torch.rand(greedy.shape[0], device=greedy.device) < self.epsilon
        return {"action": torch.where(explore, random, greedy)}
