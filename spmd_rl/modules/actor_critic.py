"""The built-in actor-critic policy (`policy.class: actor_critic`): an observation encoder (modules/encoders.py),
then separate actor and critic MLPs (SB3 / CleanRL style) over its features.

Discrete actions use a categorical distribution over the actor's logits; Box actions a diagonal Gaussian whose
log std is a state-independent parameter. The distributions are written out (log-softmax, Gaussian log density)
rather than built as torch.distributions objects: this runs once per env step on inference ranks and once per
minibatch on trainers, and constructing distribution objects costs more than the math.

The actor and the critic have the same hidden widths and read the same features, so they run side by side
(TwinMLP): one matmul per layer for both. On networks this small each op's fixed cost, not its arithmetic, is the
time, and pairing them halves the ops of every forward and backward pass. They are saved as two nn.Sequential
MLPs (`actor.0.weight`, ..., `critic.4.bias`), the layout they had before they were paired.
"""

from __future__ import annotations

import functools
import math

import gymnasium as gym
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from spmd_rl.comm.sharding import is_dtensor
from spmd_rl.interfaces.policy import Policy, StepField
from spmd_rl.modules.configs import ActorCriticConfig
from spmd_rl.modules.distributions import (
    decision_sum,
    gaussian_entropy,
    gaussian_log_prob,
    tempered_log_std,
    tempered_logits,
)
from spmd_rl.modules.encoders import make_encoder
from spmd_rl.modules.masks import action_mask_of, masked
from spmd_rl.modules.mlp import ACTIVATIONS, mlp
from spmd_rl.runtime.errors import UserError

ACTIVATION_FUNCTIONS = {"tanh": torch.tanh, "relu": torch.relu, "elu": F.elu}


# ---------------------------------------------------------------------------------------------------------------
# Two MLPs side by side


class TwinMLP(nn.Module):
    """Two MLPs of the same hidden widths over the same input, evaluated side by side.

    Packed from two nn.Sequential MLPs (Linear, activation, ..., Linear; their heads' widths may differ), weights as
    they are: each layer is one batched matmul of the pair's inputs [2, B, in] with a [2, in, out] stack of the
    pair's transposed weights (baddbmm's right operand), the first layer's input being the shared one, expanded
    without a copy. The head with fewer outputs is padded with zeros that stay zero: no output reads them, so
    their gradient is 0.
    """

    def __init__(self, first: nn.Sequential, second: nn.Sequential, activation: str):
        super().__init__()
        linears = [[m for m in net if isinstance(m, nn.Linear)] for net in (first, second)]
        shapes = [[layer.weight.shape for layer in net[:-1]] for net in linears]
        if shapes[0] != shapes[1] or linears[0][-1].in_features != linears[1][-1].in_features:
            raise ValueError("TwinMLP pairs two MLPs of the same hidden widths")
        self.activation_name = activation
        self.activation = ACTIVATION_FUNCTIONS[activation]
        # (MLP 0's, MLP 1's) output width of every layer
        self.widths = [(a.out_features, b.out_features) for a, b in zip(*linears)]
        self.out_features = self.widths[-1]
        separate = {
            f"{i}.{2 * k}.{kind}": getattr(layer, kind)
            for i, net in enumerate(linears)
            for k, layer in enumerate(net)
            for kind in ("weight", "bias")
        }
        # Plain attributes, fetched by name: a ParameterList's indexing and slicing cost microseconds per forward.
        self.parameter_names = [(f"weight_{k}", f"bias_{k}") for k in range(len(self.widths))]
        for (weight_name, bias_name), weight, bias in zip(self.parameter_names, *self.packed(separate)):
            self.register_parameter(weight_name, nn.Parameter(weight))
            self.register_parameter(bias_name, nn.Parameter(bias))

    def layers(self) -> list[tuple[Tensor, Tensor]]:
        """(weight [2, in, out], bias [2, 1, out]) of each packed layer, first to last."""
        return [(getattr(self, w), getattr(self, b)) for w, b in self.parameter_names]

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(MLP 0's output [B, out_0], MLP 1's output [B, out_1]) for input x [B, in]."""
        *hidden, (head_weight, head_bias) = self.layers()
        h = x.expand(2, *x.shape)
        for weight, bias in hidden:
            h = self.activation(torch.baddbmm(bias, h, weight))
        # float(): under bf16 autocast (train.precision, inference.dtype) the heads' outputs, from which log-probs
        # and values are computed, are float32; a no-op (the same tensor) in float32.
        out = torch.baddbmm(head_bias, h, head_weight).float()  # [2, B, max(out_0, out_1)]
        width = out.shape[-1]
        out_0, out_1 = self.out_features
        return out[0] if out_0 == width else out[0, :, :out_0], out[1] if out_1 == width else out[1, :, :out_1]

    def separate_state(self) -> dict[str, Tensor]:
        """The pair as two nn.Sequential MLPs' state: keys `<i>.<layer index in the Sequential>.weight|bias`."""
        state = {}
        with torch.no_grad():
            for i in range(2):
                for k, (weight, bias) in enumerate(self.layers()):
                    width = self.widths[k][i]
                    state[f"{i}.{2 * k}.weight"] = weight[i, :, :width].t().clone()
                    state[f"{i}.{2 * k}.bias"] = bias[i, 0, :width].clone()
        return state

    def packed(self, state: dict[str, Tensor]) -> tuple[list[Tensor], list[Tensor]]:
        """The packed (weights, biases) from separate_state's layout."""
        weights, biases = [], []
        with torch.no_grad():
            for k, widths in enumerate(self.widths):
                pad = [(0, max(widths) - width) for width in widths]
                weights.append(torch.stack([F.pad(state[f"{i}.{2 * k}.weight"].t(), pad[i]) for i in range(2)]))
                biases.append(torch.stack([F.pad(state[f"{i}.{2 * k}.bias"], pad[i]) for i in range(2)])[:, None])
        return weights, biases

    def separate(self, index: int) -> nn.Sequential:
        """MLP `index` as a standalone nn.Sequential with a copy of its current weights (for inspection)."""
        state = self.separate_state()
        layers: list[nn.Module] = []
        for k in range(len(self.widths)):
            weight = state[f"{index}.{2 * k}.weight"]
            linear = nn.Linear(weight.shape[1], weight.shape[0])
            linear.load_state_dict({"weight": weight, "bias": state[f"{index}.{2 * k}.bias"]})
            layers += [linear, ACTIVATIONS[self.activation_name]()]
        return nn.Sequential(*layers[:-1])


def save_as_separate(owner: nn.Module, attribute: str, names: tuple[str, str]) -> None:
    """Make owner.<attribute>, a TwinMLP, save and load as two nn.Sequential MLPs named names[0] and names[1]: the
    layout of state_dict(), policy.pt and checkpoints stays that of two separate networks (files written before
    the pair was packed load as they are). Parameters, gradients and optimizers see the packed tensors."""
    save = functools.partial(_save_separate, attribute=attribute, names=names)
    load = functools.partial(_load_separate, attribute=attribute, names=names)
    owner.register_state_dict_post_hook(save)
    owner.register_load_state_dict_pre_hook(load)


def _save_separate(module: nn.Module, state_dict: dict, prefix: str, local_metadata, *, attribute, names) -> None:
    twin = getattr(module, attribute)
    if is_dtensor(getattr(twin, twin.parameter_names[0][0])):
        return  # sharded (train.parallel=fsdp): the packed tensors are saved as they are, shard by shard
    packed_prefix = f"{prefix}{attribute}."
    for key in [k for k in state_dict if k.startswith(packed_prefix)]:
        del state_dict[key]
    for key, value in twin.separate_state().items():
        index, rest = key.split(".", 1)
        state_dict[f"{prefix}{names[int(index)]}.{rest}"] = value


def _load_separate(module: nn.Module, state_dict: dict, prefix: str, *args, attribute, names) -> None:
    if f"{prefix}{names[0]}.0.weight" not in state_dict:
        return  # already the packed layout (or keys are missing, which load_state_dict reports)
    separate = {}
    for index, name in enumerate(names):
        for key in [k for k in state_dict if k.startswith(f"{prefix}{name}.")]:
            separate[f"{index}.{key[len(prefix) + len(name) + 1 :]}"] = state_dict.pop(key)
    twin = getattr(module, attribute)
    for (weight_name, bias_name), weight, bias in zip(twin.parameter_names, *twin.packed(separate)):
        state_dict[f"{prefix}{attribute}.{weight_name}"] = weight
        state_dict[f"{prefix}{attribute}.{bias_name}"] = bias


# ---------------------------------------------------------------------------------------------------------------
# The policy


def _check_action_space(action_space: gym.Space) -> None:
    supported = "Discrete (start 0) or a Box (of any shape: an action chunk is a Box [K, *shape])"
    if isinstance(action_space, gym.spaces.Discrete):
        if int(action_space.start) != 0:
            raise UserError(f"action space {action_space} is not supported by the actor-critic ({supported})")
        return
    if not (isinstance(action_space, gym.spaces.Box) and len(action_space.shape) >= 1):
        raise UserError(
            f"action space {action_space} is not supported by the actor-critic ({supported}); "
            f"wrap the env or bring your own policy.class"
        )


def check_vector_action_space(action_space: gym.Space, policy_name: str) -> None:
    """Discrete (start 0) or a 1-D Box, the action spaces the built-in policies' heads take."""
    discrete = isinstance(action_space, gym.spaces.Discrete) and int(action_space.start) == 0
    if not (discrete or (isinstance(action_space, gym.spaces.Box) and len(action_space.shape) == 1)):
        raise UserError(
            f"action space {action_space} is not supported by the {policy_name} (Discrete (start 0) or a "
            f"1-D Box); wrap the env or bring your own policy.class"
        )


class ActionHeadPolicy(Policy):
    """A policy whose action head add_action_head makes (the built-in actor-critics): the attributes it sets."""

    discrete: bool
    action_field: StepField
    log_std: nn.Parameter  # for a Box action space only


def add_action_head(policy: ActionHeadPolicy, action_space: gym.Space, log_std_init: float) -> int:
    """Set policy.discrete and policy.action_field and, for a Box, register its log_std parameter; returns the
    actor's output width (logits, or the Gaussian's mean: one per element of the Box, flattened). Shared by the
    built-in actor-critic policies."""
    if isinstance(action_space, gym.spaces.Discrete):
        policy.discrete = True
        policy.action_field = StepField((), torch.int64)
        return int(action_space.n)
    policy.discrete = False
    assert action_space.shape is not None  # a Box (checked by the caller)
    policy.action_field = StepField(tuple(int(n) for n in action_space.shape), torch.float32)
    actor_out = math.prod(policy.action_field.shape)
    policy.log_std = nn.Parameter(torch.full((actor_out,), float(log_std_init)))
    return actor_out


def actor_critic_outputs(action_field: StepField) -> dict[str, StepField]:
    """The per-step outputs PPO needs from a rollout: the action, its log-prob and the critic's value."""
    return {"action": action_field, "log_prob": StepField((), torch.float32), "value": StepField((), torch.float32)}


class ActorCritic(ActionHeadPolicy):
    """Actor and critic MLPs over encoded observations; `forward(obs, action)` is `evaluate` so DDP can wrap it.

    Its outputs per step: the action, its log-prob and the critic's value (what PPO needs from a rollout)."""

    Config = ActorCriticConfig

    def __init__(self, observation_space: gym.Space, action_space: gym.Space, config: ActorCriticConfig):
        super().__init__(observation_space, action_space, config)
        _check_action_space(action_space)
        self.action_bins = config.action_bins
        self.temperature = config.temperature  # rollouts sample at it; log-probs are its (modules/distributions.py)
        if self.action_bins:
            actor_out = self._add_binned_head(action_space)
        else:
            actor_out = add_action_head(self, action_space, config.log_std_init)
        self.encoder = make_encoder(observation_space, config)
        hidden, activation = list(config.hidden_sizes), config.activation
        # Built as two MLPs (their initialization, and the random numbers it draws, as before pairing), then packed.
        ortho = config.ortho_init
        actor = mlp(self.encoder.out_features, hidden, actor_out, activation, head_gain=0.01, ortho_init=ortho)
        critic = mlp(self.encoder.out_features, hidden, 1, activation, head_gain=1.0, ortho_init=ortho)
        self.actor_and_critic = TwinMLP(actor, critic, activation)
        save_as_separate(self, "actor_and_critic", ("actor", "critic"))

    @property
    def actor(self) -> nn.Sequential:
        """The actor MLP alone (features -> logits or Gaussian mean), a copy of its current weights."""
        return self.actor_and_critic.separate(0)

    @property
    def critic(self) -> nn.Sequential:
        """The critic MLP alone (features -> value [B, 1]), a copy of its current weights."""
        return self.actor_and_critic.separate(1)

    def outputs(self) -> dict[str, StepField]:
        return actor_critic_outputs(self.action_field)

    def update_normalizer(self, obs, context) -> None:
        self.encoder.update_normalizer(obs, context)

    def value(self, obs) -> Tensor:
        """V(obs), shape [B]."""
        return self.actor_and_critic(self.encoder(obs))[1].squeeze(-1)

    def act(self, obs, deterministic: bool = False) -> dict[str, Tensor]:
        """Sample actions (the mode when deterministic) with their log-probs and values. Continuous actions are
        unclipped; the env side clips. Every caller runs it under torch.no_grad() (the API's promise), so it adds
        no grad context of its own: this runs once per env step."""
        out, value = self.actor_and_critic(self.encoder(obs))
        if self.discrete:
            # An action mask in the observation (modules/masks.py): the disallowed actions get probability 0.
            log_probs = torch.log_softmax(tempered_logits(masked(out, action_mask_of(obs)), self.temperature), dim=-1)
            if deterministic:
                action = log_probs.argmax(-1)
            else:
                # Gumbel-max in its exponential form: with E_i ~ Exp(1), argmax_i p_i / E_i is i with probability
                # p_i. Four small ops; torch.multinomial costs twice as much per call at these sizes.
                action = (log_probs - torch.empty_like(log_probs).exponential_().log()).argmax(-1)
            log_prob = log_probs.gather(-1, action.unsqueeze(-1)).squeeze(-1)
        elif self.action_bins:
            log_probs = self._bin_log_probs(out)  # [B, elements, bins]
            if deterministic:
                index = log_probs.argmax(-1)
            else:  # Gumbel-max, as for Discrete above
                index = (log_probs - torch.empty_like(log_probs).exponential_().log()).argmax(-1)
            log_prob = log_probs.gather(-1, index.unsqueeze(-1)).squeeze(-1).sum(-1)
            action = (self.bin_low + index * self.bin_width).reshape(-1, *self.action_field.shape)
        else:
            log_std = tempered_log_std(self.log_std, self.temperature)
            action = out if deterministic else out + log_std.exp() * torch.randn_like(out)
            log_prob = gaussian_log_prob(out, action, log_std)
            action = action.reshape(-1, *self.action_field.shape)  # a Box of more than one axis (e.g. a chunk [K, A])
        return {"action": action, "log_prob": log_prob, "value": value.squeeze(-1)}

    def evaluate(self, obs, action: Tensor, chunk_valid: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """(log_prob, entropy, value) of given actions, with gradients. With action chunks, chunk_valid [B, K] makes
        log_prob the chunk's valid steps' only (modules/distributions.py; bc on demonstrations); entropy stays the
        whole chunk's."""
        out, value = self.actor_and_critic(self.encoder(obs))
        if self.discrete:
            log_probs = torch.log_softmax(tempered_logits(masked(out, action_mask_of(obs)), self.temperature), dim=-1)
            # nll_loss picks each row's log-prob in one op (and one cheap backward) instead of gather + reshapes
            log_prob = -F.nll_loss(log_probs, action.long(), reduction="none")
            entropy = -(log_probs.exp() * log_probs).sum(-1)
        elif self.action_bins:
            log_probs = self._bin_log_probs(out)
            element = action.reshape(out.shape[0], -1)
            index = ((element - self.bin_low) / self.bin_width).round().long().clamp(0, self.action_bins - 1)
            log_prob = decision_sum(log_probs.gather(-1, index.unsqueeze(-1)).squeeze(-1), chunk_valid)
            entropy = -(log_probs.exp() * log_probs).sum((-2, -1))
        else:
            # A chunk's log-prob (and entropy) is its actions' summed, the probability of the whole decision.
            log_std = tempered_log_std(self.log_std, self.temperature)
            log_prob = gaussian_log_prob(out, action.reshape(out.shape), log_std, chunk_valid)
            entropy = gaussian_entropy(log_std, out.shape[0])
        return log_prob, entropy, value.squeeze(-1)

    def forward(self, obs, action: Tensor, chunk_valid: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        # DDP only hooks forward(): the trainer calls ddp_policy(obs, action) to get evaluate() with synced grads.
        return self.evaluate(obs, action, chunk_valid)

    def _add_binned_head(self, action_space: gym.Space) -> int:
        """policy.action_bins: every element of a Box action (of each step of a chunk) is one of action_bins evenly
        spaced values from its low to its high bound, chosen by a categorical of its own; a decision's log-prob is
        its elements' summed. Returns the actor's output width (the logits of every element's bins)."""
        bins = self.action_bins
        if not isinstance(action_space, gym.spaces.Box) or bins < 2:
            raise UserError(
                f"policy.action_bins={bins} bins a Box action space into 2 or more values per element; "
                f"{action_space} cannot be binned that way: set policy.action_bins=0 (or at least 2 for a Box)"
            )
        low, high = (
            torch.as_tensor(bound, dtype=torch.float32).reshape(-1) for bound in (action_space.low, action_space.high)
        )
        if not (torch.isfinite(low).all() and torch.isfinite(high).all()):
            raise UserError(
                f"policy.action_bins={bins} needs finite action bounds; {action_space} has infinite ones: wrap the "
                f"env to bound its actions, or set policy.action_bins=0 (a Gaussian)"
            )
        self.discrete = False
        self.action_field = StepField(tuple(int(n) for n in action_space.shape), torch.float32)
        # Not persistent: the bins follow from the action space, which every rank has; the weights stay as they are.
        self.register_buffer("bin_low", low, persistent=False)
        self.register_buffer("bin_width", (high - low) / (bins - 1), persistent=False)
        return low.numel() * bins

    def _bin_log_probs(self, out: Tensor) -> Tensor:
        """Each action element's log-probabilities over its bins, [B, elements, bins]."""
        logits = out.reshape(out.shape[0], -1, self.action_bins)
        return torch.log_softmax(tempered_logits(logits, self.temperature), dim=-1)
