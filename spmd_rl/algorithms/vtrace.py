"""V-trace off-policy targets (Espeholt et al. 2018, "IMPALA", section 4.1), for learning from steps that acted
with older weights than the learner's (the async engine's policy lag).

In the paper's order, for a [T, N] rollout acted by the behaviour policy mu and learned by the target policy pi:

    rho_t   = min(rho_bar, pi(a_t|x_t) / mu(a_t|x_t))                      truncated importance weight
    c_i     = lambda * min(c_bar, pi(a_i|x_i) / mu(a_i|x_i))               truncated "trace cutting" weight
    delta_t = rho_t * (r_t + gamma * V(x_{t+1}) - V(x_t))                  temporal difference, weighted
    v_s     = V(x_s) + sum_{t>=s} gamma^(t-s) * (prod_{i=s}^{t-1} c_i) * delta_t         the V-trace target
            computed backwards:  v_s - V(x_s) = delta_s + gamma * c_s * (v_{s+1} - V(x_{s+1}))
    A_s     = rho_s * (r_s + gamma * v_{s+1} - V(x_s))                     the policy-gradient advantage

(lambda is the paper's remark on mixing in TD(lambda); lambda = 1 is plain V-trace.) On-policy (pi = mu, and
rho_bar, c_bar >= 1) the targets are the lambda-returns, i.e. GAE's returns with gae_lambda = lambda.

Episode ends follow gymnasium's NEXT_STEP autoreset, as in compute_gae: a terminated step has no future value; a
truncated step bootstraps from V(final observation), recorded at the step after it; after either end nothing flows
back from the following (reset) step, and that step's own target is never used by the step before it.
"""

from __future__ import annotations

import torch
from torch import Tensor


def vtrace(
    behaviour_log_prob: Tensor,
    target_log_prob: Tensor,
    rewards: Tensor,
    values: Tensor,
    next_value: Tensor,
    terminated: Tensor,
    truncated: Tensor,
    gamma: float,
    lam: float = 1.0,
    rho_bar: float = 1.0,
    c_bar: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """(v_s targets, policy-gradient advantages A_s), each [T, N]; next_value [N] is V of the obs after the last
    step. All inputs [T, N] except next_value; log-probs of the actions taken."""
    ratio = (target_log_prob - behaviour_log_prob).exp()
    rho = ratio.clamp(max=rho_bar)
    c = lam * ratio.clamp(max=c_bar)
    # V(x_{t+1}): the value recorded at the next step (after a truncated step, V of the final obs).
    next_values = torch.cat([values[1:], next_value.unsqueeze(0)])
    not_terminated = 1.0 - terminated.float()
    not_done = 1.0 - (terminated | truncated).float()
    deltas = rho * (rewards + gamma * not_terminated * next_values - values)

    corrections = torch.empty_like(values)  # v_s - V(x_s)
    running = torch.zeros_like(next_value)  # v_{T} - V(x_T) = 0: the last value is not corrected
    for t in reversed(range(rewards.shape[0])):
        running = deltas[t] + gamma * c[t] * not_done[t] * running
        corrections[t] = running
    targets = values + corrections

    # v_{s+1} for the advantage: the next step's target inside an episode; at an episode's end the bootstrap value
    # V(final obs) (truncated) or nothing (terminated), never the reset step's target.
    next_targets = torch.cat([targets[1:], next_value.unsqueeze(0)])
    next_targets = torch.where(not_done.bool(), next_targets, next_values)
    advantages = rho * (rewards + gamma * not_terminated * next_targets - values)
    return targets, advantages
