"""The built-in policies' action distributions, written out (see modules/actor_critic.py for why), and the rollout
sampling temperature (`policy.temperature`).

At temperature T a Gaussian's std is std * T (its log std plus log T) and a categorical's logits are logits / T. The
temperature belongs to the policy's distribution, not only to its sampling: `act` samples from the tempered
distribution and returns that distribution's log-prob, and `evaluate` gives the same distribution's log-prob and
entropy, so an algorithm's ratio compares like with like (it is 1 on the first minibatch of an update). At T = 1 no op
is added: the policy computes exactly what it did before the key existed. The mode (deterministic acting) does not
depend on T.

A decision's log-prob is its action elements' summed (an action chunk's: all its K steps'). With `chunk_valid`
[B, K] (bc on demonstrations whose episodes end mid-chunk) it is the sum over the chunk's valid steps only: the
elements of the others are replaced by 0 before the sum, so neither their values nor their gradients depend on the
actions recorded there (zeros past an episode's end). Without it the sum is the one it always was.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


def tempered_logits(logits: Tensor, temperature: float) -> Tensor:
    """A categorical's logits at the sampling temperature (the logits themselves at T = 1)."""
    return logits if temperature == 1.0 else logits / temperature


def tempered_log_std(log_std: Tensor, temperature: float) -> Tensor:
    """A Gaussian's log std at the sampling temperature, log(std * T) (the parameter itself at T = 1)."""
    return log_std if temperature == 1.0 else log_std + math.log(temperature)


def decision_sum(elements: Tensor, chunk_valid: Tensor | None = None) -> Tensor:
    """A decision's log-prob from its action elements' [B, elements] (a chunk's step-major: K steps, each of
    elements / K): their sum, or with chunk_valid [B, K] the sum over the valid steps' elements only: [B]."""
    if chunk_valid is None:
        return elements.sum(-1)
    steps = elements.reshape(*chunk_valid.shape, -1)
    return torch.where(chunk_valid.unsqueeze(-1), steps, 0.0).sum((-2, -1))


def gaussian_log_prob(mean: Tensor, action: Tensor, log_std: Tensor, chunk_valid: Tensor | None = None) -> Tensor:
    """The log density of a diagonal Gaussian at action, summed over the last axis (with chunk_valid: over the
    chunk's valid steps, decision_sum): [B]."""
    z = (action - mean) * torch.exp(-log_std)
    return decision_sum(-0.5 * z.square() - log_std - LOG_SQRT_2PI, chunk_valid)


def gaussian_entropy(log_std: Tensor, batch: int) -> Tensor:
    """A diagonal Gaussian's entropy (state-independent log std), for each of batch samples: [batch]."""
    return (0.5 + LOG_SQRT_2PI + log_std).sum().expand(batch)
