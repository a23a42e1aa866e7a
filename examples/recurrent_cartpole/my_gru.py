"""A user's own recurrent policy, written against spmd_rl.api alone: a GRU over the observation, a softmax actor and
a value head on its output. It trains with the built-in RecurrentPPO, which asks of a policy `act(obs, deterministic,
state)` -> (outputs, next_state), `evaluate_sequence` and `value_sequence` over [T, B] sequences, and `forward`
routed to `evaluate_sequence` (DDP syncs the gradients of what goes through forward).

    python -m spmd_rl.main --config my_gru.yaml      # from this folder
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from spmd_rl.api import Policy, StepField, knob


@dataclass
class MyGRUConfig:
    size: int = knob(32, "GRU width", min=1)


class MyGRU(Policy):
    Config = MyGRUConfig

    def __init__(self, observation_space, action_space, config: MyGRUConfig):
        super().__init__(observation_space, action_space, config)
        self.cell = nn.GRUCell(observation_space.shape[0], config.size)
        self.actor = nn.Linear(config.size, action_space.n)
        self.critic = nn.Linear(config.size, 1)

    def outputs(self):
        return {
            "action": StepField((), torch.int64),
            "log_prob": StepField((), torch.float32),
            "value": StepField((), torch.float32),
        }

    def recurrent_state(self):
        return {"h": StepField((self.config.size,), torch.float32)}  # zeros at every episode start

    def act(self, obs: Tensor, deterministic: bool = False, state: dict | None = None):
        h = self.cell(obs.float(), state["h"])
        log_probs = torch.log_softmax(self.actor(h), dim=-1)
        action = log_probs.argmax(-1) if deterministic else torch.multinomial(log_probs.exp(), 1).squeeze(-1)
        outputs = {
            "action": action,
            "log_prob": log_probs.gather(-1, action.unsqueeze(-1)).squeeze(-1),
            "value": self.critic(h).squeeze(-1),
        }
        return outputs, {"h": h}

    def _unroll(self, obs: Tensor, episode_start: Tensor, state: dict) -> Tensor:
        """The GRU's outputs [T, B, size] from the state the first step entered with; zero where episodes start."""
        h, outputs = state["h"], []
        for t in range(obs.shape[0]):
            h = self.cell(obs[t].float(), h * (~episode_start[t]).unsqueeze(-1))
            outputs.append(h)
        return torch.stack(outputs)

    def evaluate_sequence(self, obs, action, episode_start, state):
        h = self._unroll(obs, episode_start, state)
        log_probs = torch.log_softmax(self.actor(h), dim=-1)
        log_prob = log_probs.gather(-1, action.long().unsqueeze(-1)).squeeze(-1)
        entropy = -(log_probs.exp() * log_probs).sum(-1)
        return log_prob, entropy, self.critic(h).squeeze(-1)

    def value_sequence(self, obs, episode_start, state):
        return self.critic(self._unroll(obs, episode_start, state)).squeeze(-1)

    def forward(self, obs, action, episode_start, state):
        return self.evaluate_sequence(obs, action, episode_start, state)
