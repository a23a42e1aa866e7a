"""The built-in transformer policy (`policy.class: transformer`): observations as tokens, a pre-norm transformer
encoder over them and a readout token, then linear actor and critic heads on the readout.

Tokens: a vector observation (a Box that is not an image, flattened) is one token, or `vector_tokens` equal
contiguous groups of its features, each group with its own linear embedding; it goes through the same running
normalizer as the actor-critic's vectors (policy.normalize_obs). An image (the actor-critic's test: uint8 or 1-4
channels, H x W x C or C x H x W; and any 3-D uint8 Box, however small) is cut into `patch_size` square patches
by a strided convolution (zero-padded to a multiple of the patch), one token each. A text (token ids and their
mask, envs/text.py) is its tokens, each id through a learned embedding; its padding is masked out of attention.
A Dict observation is the
tokens of each key in the space's key order, each key with its own embedding. A learned readout token goes first,
and a learned position embedding is added to every position, so a token's position also says which key (and
which patch or group) it came from.

The blocks are written out (attention through torch's scaled_dot_product_attention) rather than taken from
nn.TransformerEncoderLayer: that layer switches to a fused inference kernel outside training mode, so acting and
learning would not run the same arithmetic, and its mask and nested-tensor handling has nothing to do here. Each
block is one shard unit (`shard_units()`), what the FSDP trainers shard one by one.

The outputs and methods are the actor-critic's (action, log_prob, value; act, evaluate, value, forward =
evaluate), so PPO and V-trace use it unchanged: a categorical over Discrete actions, or a diagonal Gaussian over a
1-D Box with a state-independent log std.
"""

from __future__ import annotations

from typing import Protocol, cast

import gymnasium as gym
import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from spmd_rl.envs.text import TokenizedText
from spmd_rl.interfaces.policy import StepField
from spmd_rl.modules.actor_critic import (
    ActionHeadPolicy,
    actor_critic_outputs,
    add_action_head,
    check_vector_action_space,
)
from spmd_rl.modules.configs import TransformerConfig
from spmd_rl.modules.distributions import gaussian_entropy, gaussian_log_prob, tempered_log_std, tempered_logits
from spmd_rl.modules.encoders import VectorEncoder, image_batch, image_layout, is_image
from spmd_rl.runtime.errors import UserError

INIT_STD = 0.02  # the usual transformer init (GPT-2, ViT) for embeddings and the blocks' weights


# ---------------------------------------------------------------------------------------------------------------
# Tokens


class Tokenizer(nn.Module):
    """An observation as tokens of the policy's width: how many it makes, and the running statistics it may hold."""

    tokens: int

    def update_normalizer(self, obs, context) -> None:
        raise NotImplementedError


class MaskedTokens(Protocol):
    """A tokenizer with an `attention_mask` (TextTokens, DictTokens): found with hasattr, as a Tokenizer need not
    have one."""

    def attention_mask(self, obs) -> Tensor | None: ...


class VectorTokens(Tokenizer):
    """A vector observation (flattened, optionally normalized) as `tokens` tokens of `width`: equal contiguous
    groups of its features, each group through its own linear map."""

    def __init__(self, space: gym.spaces.Box, tokens: int, width: int, normalize: bool, where: str):
        super().__init__()
        self.features = VectorEncoder(space, normalize)
        count = self.features.out_features
        if count % tokens:
            divisors = [d for d in range(1, count + 1) if count % d == 0]
            raise UserError(
                f"policy.vector_tokens={tokens} does not divide the {count} features of the observation{where}; "
                f"choose one of {divisors}"
            )
        self.tokens, self.group = tokens, count // tokens
        self.weight = nn.Parameter(torch.empty(tokens, self.group, width))
        self.bias = nn.Parameter(torch.zeros(tokens, width))
        nn.init.trunc_normal_(self.weight, std=INIT_STD)

    def forward(self, obs: Tensor) -> Tensor:
        x = self.features(obs).reshape(obs.shape[0], self.tokens, self.group)
        return torch.einsum("btg,tgw->btw", x, self.weight) + self.bias

    def update_normalizer(self, obs: Tensor, context) -> None:
        self.features.update_normalizer(obs, context)


class PatchTokens(Tokenizer):
    """An image as one token per `patch` x `patch` square (a convolution with stride = kernel), the image
    zero-padded at its bottom and right to a multiple of the patch; uint8 pixels become floats in [0, 1]."""

    def __init__(self, space: gym.spaces.Box, patch: int, width: int):
        super().__init__()
        self.channel_last, self.image_shape, self.scale = image_layout(space)
        channels, height, columns = self.image_shape
        self.padding = (0, -columns % patch, 0, -height % patch)  # F.pad's order: left, right, top, bottom
        self.tokens = -(-height // patch) * -(-columns // patch)
        self.embed = nn.Conv2d(channels, width, patch, stride=patch)
        nn.init.trunc_normal_(self.embed.weight, std=INIT_STD)
        assert self.embed.bias is not None  # built with its default bias
        nn.init.zeros_(self.embed.bias)

    def forward(self, obs: Tensor) -> Tensor:
        x = image_batch(obs, self.channel_last, self.image_shape, self.scale)
        if any(self.padding):
            x = F.pad(x, self.padding)
        return self.embed(x).flatten(2).transpose(1, 2)  # [B, width, h, w] -> [B, h * w, width]

    def update_normalizer(self, obs: Tensor, context) -> None:
        pass


class TextTokens(Tokenizer):
    """A text (token ids and their mask, envs/text.py) as its tokens: a learned embedding of each id. The padding
    after the text is masked out of attention (`attention_mask`)."""

    def __init__(self, space: TokenizedText, width: int):
        super().__init__()
        self.tokens = cast(gym.spaces.Box, space["ids"]).shape[0]  # a Box (TokenizedText)
        self.embed = nn.Embedding(space.vocab_size, width)
        nn.init.trunc_normal_(self.embed.weight, std=INIT_STD)

    def forward(self, obs) -> Tensor:
        return self.embed(obs["ids"].long())

    def attention_mask(self, obs) -> Tensor:
        return obs["mask"].bool()

    def update_normalizer(self, obs, context) -> None:
        pass


class DictTokens(Tokenizer):
    """Each key's tokens (its own embedding), concatenated in the space's key order."""

    def __init__(self, space: gym.spaces.Dict, config: TransformerConfig, where: str):
        super().__init__()
        parts = {key: make_tokens(sub, config, f"{where}['{key}']") for key, sub in space.spaces.items()}
        self.parts = nn.ModuleDict(parts)
        self.tokens = sum(part.tokens for part in parts.values())
        self.masked = any(hasattr(part, "attention_mask") for part in parts.values())

    def forward(self, obs) -> Tensor:
        return torch.cat([part(obs[key]) for key, part in self.parts.items()], dim=1)

    def attention_mask(self, obs) -> Tensor | None:
        """[B, tokens] True where a token takes part in attention (None: all of them, no text inside)."""
        if not self.masked:
            return None
        masks: list[Tensor] = []
        for key, part in self.parts.items():  # a ModuleDict's values are typed Module
            mask = cast(MaskedTokens, part).attention_mask(obs[key]) if hasattr(part, "attention_mask") else None
            if mask is None:  # every token of this part attends (no text in it, e.g. a nested Dict of Boxes)
                tokens = cast(Tokenizer, part).tokens
                mask = torch.ones(obs.batch_size[0], tokens, dtype=torch.bool, device=obs.device)
            masks.append(mask)
        return torch.cat(masks, dim=1)

    def update_normalizer(self, obs, context) -> None:
        for key, part in self.parts.items():
            cast(Tokenizer, part).update_normalizer(obs[key], context)  # a ModuleDict's values are typed Module


def make_tokens(space: gym.Space, config: TransformerConfig, where: str = "") -> Tokenizer:
    """The tokenizer of an observation space; `.tokens` is how many tokens it makes."""
    if isinstance(space, TokenizedText):
        return TextTokens(space, config.width)
    if isinstance(space, gym.spaces.Dict):
        return DictTokens(space, config, where)
    if not isinstance(space, gym.spaces.Box):
        raise UserError(
            f"observation space {space}{where} is not supported by the transformer policy (Box, Text, Dict of "
            f"those); "
            f"wrap the env (e.g. gymnasium's FlattenObservation) or bring your own policy.class"
        )
    if is_image(space) or (len(space.shape) == 3 and space.dtype == np.uint8):  # small frames too (Catch: 10x5x1)
        return PatchTokens(space, config.patch_size, config.width)
    return VectorTokens(space, config.vector_tokens, config.width, config.normalize_obs, where)


# ---------------------------------------------------------------------------------------------------------------
# Blocks


class Block(nn.Module):
    """Pre-norm transformer block: x + attention(norm(x)), then x + MLP(norm(x)) (GELU)."""

    def __init__(self, width: int, heads: int, mlp_width: int):
        super().__init__()
        self.heads = heads
        self.attention_norm = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.projection = nn.Linear(width, width)
        self.mlp_norm = nn.LayerNorm(width)
        mlp_in, mlp_out = nn.Linear(width, mlp_width), nn.Linear(mlp_width, width)
        self.mlp = nn.Sequential(mlp_in, nn.GELU(), mlp_out)
        for linear in (self.qkv, self.projection, mlp_in, mlp_out):
            nn.init.trunc_normal_(linear.weight, std=INIT_STD)
            nn.init.zeros_(linear.bias)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        """mask: None, or [B, 1, 1, T] True for the tokens every token may attend to (a text's padding is not)."""
        batch, tokens, width = x.shape
        qkv = self.qkv(self.attention_norm(x)).reshape(batch, tokens, 3, self.heads, width // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each [B, heads, T, head width]
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(batch, tokens, width)
        x = x + self.projection(attended)
        return x + self.mlp(self.mlp_norm(x))


# ---------------------------------------------------------------------------------------------------------------
# The policy


class TransformerPolicy(ActionHeadPolicy):
    """Tokens, a readout token and a position embedding, `depth` pre-norm blocks, a final norm, then linear actor
    and critic heads on the readout token; `forward(obs, action)` is `evaluate` so DDP and FSDP can wrap it."""

    Config = TransformerConfig

    def __init__(self, observation_space: gym.Space, action_space: gym.Space, config: TransformerConfig):
        super().__init__(observation_space, action_space, config)
        check_vector_action_space(action_space, "transformer policy")
        width = config.width
        if width % config.heads:
            raise UserError(f"policy.heads={config.heads} must divide policy.width={width}")
        mlp_width = round(width * config.mlp_ratio)
        if mlp_width < 1:
            raise UserError(f"policy.mlp_ratio={config.mlp_ratio} gives blocks an MLP of width 0; use at least 1/width")
        actor_out = add_action_head(self, action_space, config.log_std_init)
        self.temperature = config.temperature  # rollouts sample at it; log-probs are its (modules/distributions.py)
        self.tokens = make_tokens(observation_space, config)
        self.readout = nn.Parameter(torch.zeros(1, 1, width))
        self.position = nn.Parameter(torch.zeros(1, self.tokens.tokens + 1, width))
        nn.init.trunc_normal_(self.readout, std=INIT_STD)
        nn.init.trunc_normal_(self.position, std=INIT_STD)
        self.blocks = nn.ModuleList(Block(width, config.heads, mlp_width) for _ in range(config.depth))
        self.norm = nn.LayerNorm(width)
        # As the actor-critic's heads: near-uniform first actions, a value head of unit gain.
        self.actor = nn.Linear(width, actor_out)
        self.critic = nn.Linear(width, 1)
        for head, gain in ((self.actor, 0.01), (self.critic, 1.0)):
            nn.init.orthogonal_(head.weight, gain)
            nn.init.zeros_(head.bias)

    def shard_units(self) -> list[nn.Module]:
        """The modules FSDP shards one by one (the rest goes with the root): the transformer blocks."""
        return list(self.blocks)

    def outputs(self) -> dict[str, StepField]:
        return actor_critic_outputs(self.action_field)

    def update_normalizer(self, obs, context) -> None:
        self.tokens.update_normalizer(obs, context)

    def features(self, obs) -> Tensor:
        """The readout token's final state [B, width]."""
        tokens = self.tokens(obs)
        x = torch.cat([self.readout.expand(tokens.shape[0], -1, -1), tokens], dim=1) + self.position
        mask = self._attention_mask(obs)
        for block in self.blocks:
            x = block(x) if mask is None else block(x, mask)
        return self.norm(x[:, 0])

    def _attention_mask(self, obs) -> Tensor | None:
        """[B, 1, 1, 1 + tokens]: the readout and every token but a text's padding (None without text)."""
        observed = (
            cast(MaskedTokens, self.tokens).attention_mask(obs) if hasattr(self.tokens, "attention_mask") else None
        )
        if observed is None:
            return None
        readout = torch.ones(observed.shape[0], 1, dtype=torch.bool, device=observed.device)
        return torch.cat([readout, observed], dim=1)[:, None, None, :]

    def heads(self, obs) -> tuple[Tensor, Tensor]:
        """(the actor's output [B, actions], V(obs) [B])."""
        x = self.features(obs)
        return self.actor(x), self.critic(x).squeeze(-1)

    def value(self, obs) -> Tensor:
        """V(obs), shape [B]."""
        return self.critic(self.features(obs)).squeeze(-1)

    def act(self, obs, deterministic: bool = False) -> dict[str, Tensor]:
        """Sample actions (the mode when deterministic) with their log-probs and values; continuous actions are
        unclipped (the env side clips). Called under torch.no_grad()."""
        out, value = self.heads(obs)
        if self.discrete:
            log_probs = torch.log_softmax(tempered_logits(out, self.temperature), dim=-1)
            if deterministic:
                action = log_probs.argmax(-1)
            else:  # Gumbel-max in its exponential form, as the actor-critic samples
                action = (log_probs - torch.empty_like(log_probs).exponential_().log()).argmax(-1)
            log_prob = log_probs.gather(-1, action.unsqueeze(-1)).squeeze(-1)
        else:
            log_std = tempered_log_std(self.log_std, self.temperature)
            action = out if deterministic else out + log_std.exp() * torch.randn_like(out)
            log_prob = gaussian_log_prob(out, action, log_std)
        return {"action": action, "log_prob": log_prob, "value": value}

    def evaluate(self, obs, action: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(log_prob, entropy, value) of given actions, each [B], with gradients."""
        out, value = self.heads(obs)
        if self.discrete:
            log_probs = torch.log_softmax(tempered_logits(out, self.temperature), dim=-1)
            log_prob = log_probs.gather(-1, action.long().unsqueeze(-1)).squeeze(-1)
            entropy = -(log_probs.exp() * log_probs).sum(-1)
        else:
            log_std = tempered_log_std(self.log_std, self.temperature)
            log_prob = gaussian_log_prob(out, action, log_std)
            entropy = gaussian_entropy(log_std, out.shape[0])
        return log_prob, entropy, value

    def forward(self, obs, action: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        # DDP and FSDP hook forward(): the trainer calls model(obs, action) to get evaluate() with synced grads.
        return self.evaluate(obs, action)
