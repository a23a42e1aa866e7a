"""The built-in recurrent actor-critic: an observation encoder (modules/encoders.py: MLP input, CNN, Dict), then a
GRU or LSTM cell whose state the framework carries from step to step, then separate actor and critic MLPs over the
cell's output. Select it with `policy.class: spmd_rl.modules.recurrent:RecurrentActorCritic` (RecurrentPPO's
default policy).

The state per env is declared by `recurrent_state()`: GRU h, LSTM h and c, each [recurrent_size] and starting at
0; with `critic_memory: separate` the critic's own cell adds critic_h (and critic_c). It lives outside the module:
acting gets it and returns the next one; learning replays a whole sequence [T, B] from the state its first step
acted from, resetting it where an episode starts, with the same cells, so the learner's log-probs are the ones
acting computed.
"""

from __future__ import annotations

from dataclasses import dataclass

import gymnasium as gym
import torch
from torch import Tensor, nn

from spmd_rl.config.sections import knob
from spmd_rl.interfaces.policy import StepField
from spmd_rl.modules.actor_critic import (
    ActionHeadPolicy,
    actor_critic_outputs,
    add_action_head,
    check_vector_action_space,
)
from spmd_rl.modules.configs import ActorCriticConfig
from spmd_rl.modules.distributions import gaussian_entropy, gaussian_log_prob, tempered_log_std, tempered_logits
from spmd_rl.modules.encoders import make_encoder
from spmd_rl.modules.mlp import mlp


@dataclass
class RecurrentActorCriticConfig(ActorCriticConfig):
    """The actor-critic's keys, plus the recurrent cell between the encoder and the heads."""

    cell: str = knob("gru", "the recurrent cell after the encoder", choices=["gru", "lstm"])
    recurrent_size: int = knob(64, "width of the recurrent state (GRU: h; LSTM: h and c)", min=1)
    critic_memory: str = knob(
        "shared",
        "shared: the critic reads the actor's cell without training it (the value loss, through time, saturates a "
        "cell it trains: measured, the policy then stops learning); separate: the critic has a cell of its own",
        choices=["separate", "shared"],
    )
    hidden_sizes: list[int] = knob(
        None, "hidden layer widths of the actor and critic MLPs after the cell", factory=lambda: [64], item_min=1
    )


def _flatten_time(obs, steps: int, batch: int):
    """[T, B, ...] observations (a tensor or a TensorDict) as [T * B, ...] for the encoder."""
    if isinstance(obs, Tensor):
        return obs.reshape(steps * batch, *obs.shape[2:])
    return obs.reshape(steps * batch)


def _state_name(memory: str, part: str) -> str:
    """The actor's memory is h (and c); the critic's own, critic_h (and critic_c)."""
    return part if memory == "actor" else f"{memory}_{part}"


class RecurrentActorCritic(ActionHeadPolicy):
    """Encoder -> GRU/LSTM cell -> actor and critic MLPs. `act(obs, deterministic, state=state)` acts one step
    for a batch of envs; `evaluate_sequence` / `forward` and `value_sequence` replay [T, B] sequences."""

    Config = RecurrentActorCriticConfig

    def __init__(self, observation_space: gym.Space, action_space: gym.Space, config: RecurrentActorCriticConfig):
        super().__init__(observation_space, action_space, config)
        check_vector_action_space(action_space, "recurrent actor-critic")
        actor_out = add_action_head(self, action_space, config.log_std_init)
        self.encoder = make_encoder(observation_space, config)
        self.size = config.recurrent_size
        self.lstm = config.cell == "lstm"
        cell_type = nn.LSTMCell if self.lstm else nn.GRUCell
        # One cell per memory: the actor's, and the critic's when it has its own. Trained through time by the
        # value loss, a cell the actor shares drifts into saturation (constant features: measured, the policy then
        # stops learning), so a shared cell is read by the critic without gradient.
        self.memories = ["actor", "critic"] if config.critic_memory == "separate" else ["actor"]
        self.cells = nn.ModuleDict(
            {memory: cell_type(self.encoder.out_features, self.size) for memory in self.memories}
        )
        for name, weight in self.cells.named_parameters():  # orthogonal weights, zero biases: stable early training
            if name.rsplit(".", 1)[-1].startswith("weight"):
                nn.init.orthogonal_(weight)
            else:
                nn.init.zeros_(weight)
        hidden, activation = list(config.hidden_sizes), config.activation
        self.actor = mlp(self.size, hidden, actor_out, activation, head_gain=0.01, ortho_init=config.ortho_init)
        self.critic = mlp(self.size, hidden, 1, activation, head_gain=1.0, ortho_init=config.ortho_init)

    # -- the contract ---------------------------------------------------------------------------------------------

    def outputs(self) -> dict[str, StepField]:
        return actor_critic_outputs(self.action_field)

    def recurrent_state(self) -> dict[str, StepField]:
        state = {}
        for memory in self.memories:
            for part in ("h", "c") if self.lstm else ("h",):
                state[_state_name(memory, part)] = StepField((self.size,), torch.float32)
        return state

    def update_normalizer(self, obs, context) -> None:
        self.encoder.update_normalizer(obs, context)

    # -- one step, many envs --------------------------------------------------------------------------------------

    def _step(self, features: Tensor, state: dict[str, Tensor]) -> dict[str, Tensor]:
        """Every memory's cell one step on; the next state."""
        next_state = {}
        for memory in self.memories:
            h, c = _state_name(memory, "h"), _state_name(memory, "c")
            if self.lstm:
                next_state[h], next_state[c] = self.cells[memory](features, (state[h], state[c]))
            else:
                next_state[h] = self.cells[memory](features, state[h])
        return next_state

    def _critic_input(self, state: dict[str, Tensor]) -> Tensor:
        if "critic" in self.memories:
            return state[_state_name("critic", "h")]
        return state["h"].detach()  # the shared cell learns from the policy's loss alone

    def act(self, obs, deterministic: bool = False, state: dict[str, Tensor] | None = None):
        """(outputs, next_state): actions sampled (the mode when deterministic) with their log-probs and values,
        from the state each env carries (already reset where an episode starts)."""
        if state is None:
            raise TypeError(
                "RecurrentActorCritic.act needs the recurrent state: act(obs, deterministic, state=state) with "
                "state {name: [B, *shape]} as recurrent_state() declares (spmd_rl.api.initial_state gives the first)"
            )
        next_state = self._step(self.encoder(obs), state)
        h = next_state["h"]
        out = self.actor(h)
        if self.discrete:
            log_probs = torch.log_softmax(tempered_logits(out, self.config.temperature), dim=-1)
            action = log_probs.argmax(-1) if deterministic else torch.multinomial(log_probs.exp(), 1).squeeze(-1)
            log_prob = log_probs.gather(-1, action.unsqueeze(-1)).squeeze(-1)
        else:
            log_std = tempered_log_std(self.log_std, self.config.temperature)
            action = out if deterministic else out + log_std.exp() * torch.randn_like(out)
            log_prob = gaussian_log_prob(out, action, log_std)
        outputs = {
            "action": action,
            "log_prob": log_prob,
            "value": self.critic(self._critic_input(next_state)).squeeze(-1),
        }
        return outputs, next_state

    # -- sequences [T, B] ------------------------------------------------------------------------------------------

    def unroll(self, obs, episode_start: Tensor, state: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        """(the actor's input [T * B, size], the critic's) over a sequence: the encoder on every step at once, then
        the cells step by step from `state` (the state the first step was entered with), reset to the initial value
        (zero) wherever an episode starts, as acting did."""
        steps, batch = episode_start.shape
        features = self.encoder(_flatten_time(obs, steps, batch)).reshape(steps, batch, -1)
        keep = (~episode_start).unsqueeze(-1).to(features.dtype)  # 0 where an episode starts: the state restarts
        actor, critic = [], []
        for t in range(steps):
            state = self._step(features[t], {name: value * keep[t] for name, value in state.items()})
            actor.append(state["h"])
            critic.append(self._critic_input(state))
        return torch.cat(actor), torch.cat(critic)

    def evaluate_sequence(
        self, obs, action: Tensor, episode_start: Tensor, state: dict[str, Tensor]
    ) -> tuple[Tensor, Tensor, Tensor]:
        """(log_prob, entropy, value), each [T, B], of a sequence's actions, with gradients through time."""
        steps, batch = episode_start.shape
        actor_input, critic_input = self.unroll(obs, episode_start, state)
        out = self.actor(actor_input)
        flat_action = action.reshape(steps * batch, *action.shape[2:])
        if self.discrete:
            log_probs = torch.log_softmax(tempered_logits(out, self.config.temperature), dim=-1)
            log_prob = -nn.functional.nll_loss(log_probs, flat_action.long(), reduction="none")
            entropy = -(log_probs.exp() * log_probs).sum(-1)
        else:
            log_std = tempered_log_std(self.log_std, self.config.temperature)
            log_prob = gaussian_log_prob(out, flat_action, log_std)
            entropy = gaussian_entropy(log_std, out.shape[0])
        value = self.critic(critic_input).squeeze(-1)
        return log_prob.reshape(steps, batch), entropy.reshape(steps, batch), value.reshape(steps, batch)

    def forward(self, obs, action: Tensor, episode_start: Tensor, state: dict[str, Tensor]):
        # DDP only hooks forward(): RecurrentPPO calls ddp_policy(...) to get evaluate_sequence with synced grads.
        return self.evaluate_sequence(obs, action, episode_start, state)

    def value_sequence(self, obs, episode_start: Tensor, state: dict[str, Tensor]) -> Tensor:
        """V over a sequence, [T, B]."""
        _, critic_input = self.unroll(obs, episode_start, state)
        return self.critic(critic_input).squeeze(-1).reshape(episode_start.shape)
