"""Action masks: an env with discrete actions may return a Dict observation whose `action_mask` key holds a boolean
vector over the actions (True = allowed). The built-in policies read it: PPO's actor-critic masks its logits, DQN's
Q-network its argmax and its random actions. The mask is no input feature: the encoders skip that key."""

from __future__ import annotations

import torch
from tensordict import TensorDict
from torch import Tensor

MASK_KEY = "action_mask"


def action_mask_of(obs) -> Tensor | None:
    """The boolean mask [B, n] of a batch of Dict observations that carry one; None otherwise."""
    if isinstance(obs, TensorDict) and MASK_KEY in obs.keys():
        return obs[MASK_KEY].bool()
    return None


def masked(values: Tensor, mask: Tensor | None) -> Tensor:
    """values [B, n] with the disallowed actions' entries at the dtype's lowest value (not -inf: a row whose
    actions are all masked stays finite, and log-softmax over it stays a number)."""
    if mask is None:
        return values
    return values.masked_fill(~mask, torch.finfo(values.dtype).min)
