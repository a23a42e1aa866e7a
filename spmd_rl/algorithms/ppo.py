"""Proximal Policy Optimization (Schulman et al. 2017), with the semantics of Stable-Baselines3's PPO.

Read top to bottom: advantages from a rollout (GAE), then the clipped-surrogate update over minibatches. Over 400
lines for that reason: the algorithm in paper order in one file (as CleanRL writes it), recurrent PPO taking its
update tail from here.

Rollouts come from gymnasium vector envs in NEXT_STEP autoreset mode: when step t ends an episode, the observation
recorded at t+1 is that episode's final observation and step t+1 is a reset step whose action the env ignored.
Such reset steps are marked invalid (valid=False) and every loss is a mean over valid entries only.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from tensordict import TensorDict
from torch import Tensor

from spmd_rl.algorithms.configs import PPOConfig, check_num_minibatches
from spmd_rl.algorithms.optimizer_step import FusedAdamStep, clip_grad_norm
from spmd_rl.algorithms.vtrace import vtrace
from spmd_rl.interfaces.algorithm import Algorithm, PlanFacts, PolicyMethod, Schedule, loss_forward
from spmd_rl.interfaces.context import Context
from spmd_rl.interfaces.policy import CHUNK_VALID, Policy
from spmd_rl.runtime.errors import UserError

# ---------------------------------------------------------------------------------------------------------------
# Advantages


def compute_gae(
    rewards: Tensor,
    values: Tensor,
    next_value: Tensor,
    terminated: Tensor,
    truncated: Tensor,
    gamma: float | Tensor,
    lam: float,
) -> tuple[Tensor, Tensor]:
    """Generalized advantage estimation over a [T, N] rollout; next_value [N] is V of the obs after the last step.

    delta_t = r_t + gamma * V(s_{t+1}) * (1 - terminated_t) - V(s_t)
    A_t     = delta_t + gamma * lam * (1 - done_t) * A_{t+1},   done_t = terminated_t or truncated_t

    gamma is a number, or a [T, N] tensor of each decision's own discount (action chunks: chunk_discounts).

    With NEXT_STEP autoreset, s_{t+1} after a truncated step is the episode's final observation, so a truncated
    step bootstraps from V(final obs) while a terminated step does not bootstrap at all. Either way the episode
    ends at t, so no advantage flows back across it from the reset step t+1.
    """
    # V(s_{t+1}): the value recorded at the next step (after a truncated step, V of the final obs).
    next_values = torch.cat([values[1:], next_value.unsqueeze(0)])
    # Only termination means "no future": a truncated episode still bootstraps from V(final obs).
    deltas = rewards + gamma * next_values * (1.0 - terminated.float()) - values
    # Any episode end stops advantages flowing back from the reset step that follows it.
    decay = gamma * lam * (1.0 - (terminated | truncated).float())
    advantages = torch.empty_like(rewards)
    running = torch.zeros_like(next_value)
    for t in reversed(range(rewards.shape[0])):
        running = deltas[t] + decay[t] * running
        advantages[t] = running
    return advantages, advantages + values


def chunk_discounts(rewards: Tensor, chunk_valid: Tensor, gamma: float) -> tuple[Tensor, Tensor]:
    """A rollout of action chunks as decisions: (reward [T, N], discount [T, N]) from its K rewards [T, N, K] and
    which of them ran. A chunk's reward is sum_k gamma^k r_k over the steps that ran; the next decision, E steps
    (those that ran) later, is discounted by gamma^E. GAE over decisions then discounts exactly as over steps."""
    powers = gamma ** torch.arange(rewards.shape[-1], dtype=rewards.dtype, device=rewards.device)
    valid = chunk_valid.to(rewards.dtype)
    return (rewards * valid * powers).sum(-1), gamma ** valid.sum(-1)


# ---------------------------------------------------------------------------------------------------------------
# Update


VTRACE_MAX_POLICY_LAG = 8  # the lag PPO declares with algo.vtrace (engine.max_policy_lag may lower it)

LOSS_NAMES = ("policy_loss", "value_loss", "entropy", "approx_kl", "clip_fraction")
APPROX_KL = LOSS_NAMES.index("approx_kl")


def minibatch_weights(valid: Tensor, advantage: Tensor, normalize: bool) -> tuple[Tensor, Tensor]:
    """(share, advantage) of one minibatch: each valid entry's share of a mean (0 for reset steps), so that every
    mean is one dot product with it; and the advantages normalized over the valid entries with the unbiased std,
    as SB3, when asked and there is more than one. A minibatch of reset steps only has zero losses, not NaN."""
    num_valid = valid.sum()
    share = valid / num_valid.clamp(min=1)
    if normalize and num_valid > 1:
        mean = advantage @ share
        std = ((advantage - mean).square() @ share * (num_valid / (num_valid - 1))).sqrt()
        advantage = (advantage - mean) / (std + 1e-8)
    return share, advantage


def clipped_losses(
    minibatch: dict[str, Tensor],
    share: Tensor,
    advantage: Tensor,
    new_log_prob: Tensor,
    entropy: Tensor,
    new_value: Tensor,
    clip: float,
    cfg: PPOConfig,
) -> Tensor:
    """LOSS_NAMES' values on one minibatch as one tensor [5], each a mean over the valid entries (weights share).

    minibatch holds the rollout's log_prob, return_ and value (invalid entries zeroed by rollout_tensors); the
    new_* tensors are the current policy's evaluation of the same (obs, action) pairs.
    """
    log_ratio = new_log_prob - minibatch["log_prob"]
    ratio = log_ratio.exp()
    surrogate = torch.min(advantage * ratio, advantage * ratio.clamp(1 - clip, 1 + clip))
    if cfg.clip_value_loss:  # SB3's clip_range_vf form: the prediction moves at most clip away from the old value
        old_value = minibatch["value"]
        new_value = old_value + (new_value - old_value).clamp(-clip, clip)
    with torch.no_grad():
        ratio_change = ratio - 1
        approx_kl = ratio_change - log_ratio  # the low-variance k3 estimator, as SB3
        clipped = (ratio_change.abs() > clip).float()
    if cfg.ent_coef == 0:
        entropy = entropy.detach()  # reported, but without a gradient the backward pass skips its ops
    # One row per loss, all five means in one matmul (and its one backward op). SB3's plain MSE for the value.
    terms = torch.stack([-surrogate, (new_value - minibatch["return_"]).square(), entropy, approx_kl, clipped])
    return terms @ share


def ppo_losses(
    minibatch: dict[str, Tensor], new_log_prob: Tensor, entropy: Tensor, new_value: Tensor, clip: float, cfg: PPOConfig
) -> dict[str, Tensor]:
    """The clipped-surrogate, value and entropy terms (and approx_kl, clip_fraction) on one minibatch, by name.

    minibatch holds the rollout's log_prob, advantage, return_, value and valid (its invalid entries zeroed by
    rollout_tensors); the new_* tensors are the current policy's evaluation of the same (obs, action) pairs.
    """
    share, advantage = minibatch_weights(minibatch["valid"], minibatch["advantage"], cfg.normalize_advantages)
    losses = clipped_losses(minibatch, share, advantage, new_log_prob, entropy, new_value, clip, cfg)
    return dict(zip(LOSS_NAMES, losses.unbind()))


def loss_coefficients(cfg: PPOConfig) -> Tensor:
    """The total loss as a dot product with the LOSS_NAMES vector: policy - ent_coef * entropy + vf_coef * value."""
    return torch.tensor([1.0, cfg.vf_coef, -cfg.ent_coef, 0.0, 0.0])


def gae_targets(rollout: TensorDict, next_value: Tensor, cfg: PPOConfig) -> tuple[Tensor, Tensor, Tensor]:
    """(advantage, return_, value) by GAE over a rollout [T, N], the acting values as the baseline; over decisions
    with action chunks (chunk_discounts)."""
    gamma: float | Tensor  # a tensor of discounts [T, N] over action chunks
    reward, gamma = rollout["reward"], cfg.gamma
    if CHUNK_VALID in rollout.keys():
        reward, gamma = chunk_discounts(reward, rollout[CHUNK_VALID], gamma)
    advantage, return_ = compute_gae(
        reward,
        rollout["value"],
        next_value,
        rollout["terminated"],
        rollout["truncated"],
        gamma,
        cfg.gae_lambda,
    )
    return advantage, return_, rollout["value"]


def check_lag_without_vtrace(config: PPOConfig, plan: PlanFacts) -> None:
    """An engine asking for a policy lag is told what PPO needs to tolerate it: V-trace."""
    asked = plan.asked_policy_lag
    if asked and not config.vtrace:
        raise UserError(
            f"the engine's max policy lag {asked} is more than PPO tolerates (0) without its off-policy correction: "
            f"set algo.vtrace=true (up to {VTRACE_MAX_POLICY_LAG}), or lower the engine's lag"
        )


def vtrace_targets_from(
    rollout: TensorDict, target_log_prob: Tensor, value: Tensor, next_value: Tensor, cfg: PPOConfig
) -> tuple[Tensor, Tensor, Tensor]:
    """(advantage, return_, value) by V-trace, the learner's log-probs and values [T, N] given (the target policy;
    the rollout's log_prob is the behaviour policy)."""
    return_, advantage = vtrace(
        rollout["log_prob"],
        target_log_prob,
        rollout["reward"],
        value,
        next_value,
        rollout["terminated"],
        rollout["truncated"],
        cfg.gamma,
        cfg.gae_lambda,
        cfg.vtrace_rho_bar,
        cfg.vtrace_c_bar,
    )
    return advantage, return_, value


def learner_batch(rollout: TensorDict, advantage: Tensor, return_: Tensor, value: Tensor) -> TensorDict:
    """What the clipped-surrogate update reads, [T, N] like the rollout."""
    fields = {key: rollout[key] for key in ("obs", "action", "log_prob", "valid")}
    fields.update(value=value, advantage=advantage, return_=return_)
    return TensorDict(fields, batch_size=rollout.batch_size)


def total_loss(losses: dict[str, Tensor], cfg: PPOConfig) -> Tensor:
    return losses["policy_loss"] - cfg.ent_coef * losses["entropy"] + cfg.vf_coef * losses["value_loss"]


def explained_variance(predicted: Tensor, target: Tensor) -> float:
    """1 - Var[target - predicted] / Var[target]: 1 is a perfect critic, 0 no better than a constant, NaN if flat."""
    if target.numel() < 2 or target.var() == 0:
        return float("nan")
    return float(1.0 - (target - predicted).var() / target.var())


def rollout_tensors(batch: TensorDict) -> dict[str, Tensor]:
    """The update's inputs as plain tensors, with the targets of invalid (reset) steps zeroed.

    Reset steps hold no real transition; zeroing their targets keeps anything stored there (even inf or NaN) out
    of the losses and their gradients, which a zero weight alone would not (0 * inf is NaN).
    """
    valid = batch["valid"].bool()
    data = {"obs": batch["obs"], "action": batch["action"], "valid": valid}
    for key in ("log_prob", "advantage", "return_", "value"):
        data[key] = torch.where(valid, batch[key], 0.0)
    return data


def gradient_sync(model: Any, sync: bool) -> contextlib.AbstractContextManager:
    """A context in which the model's backward averages gradients over the trainers (sync) or only accumulates
    them locally, for micro-batches: DDP's no_sync, FSDP2's set_requires_gradient_sync(False) (a module with
    neither is a single trainer's, whose gradients need no averaging)."""
    if sync:
        return contextlib.nullcontext()
    if hasattr(model, "no_sync"):
        return model.no_sync()
    if hasattr(model, "set_requires_gradient_sync"):
        return _without_gradient_sync(model)
    return contextlib.nullcontext()


@contextlib.contextmanager
def _without_gradient_sync(model: Any) -> Iterator[None]:
    """FSDP2: gradients accumulate unreduced in this block; the next backward outside it reduces them all."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def epoch_minibatches(
    data: dict[str, Tensor], num_minibatches: int, normalize: bool
) -> Iterator[tuple[dict[str, Tensor], Tensor, Tensor]]:
    """One epoch: the batch in num_minibatches random parts (sizes differ by at most one), each with its
    minibatch_weights (share, advantage)."""
    if num_minibatches == 1:  # a mean does not depend on the order: skip the shuffle and its copies
        share, advantage = minibatch_weights(data["valid"], data["advantage"], normalize)
        yield data, share, advantage
        return
    yield from shuffled_minibatches(data, num_minibatches, normalize)[0]


def shuffled_minibatches(
    data: dict[str, Tensor], num_minibatches: int, normalize: bool, epochs: int = 1
) -> list[list[tuple[dict[str, Tensor], Tensor, Tensor]]]:
    """`epochs` epochs of num_minibatches random parts of the batch each (sizes differ by at most one, as
    tensor_split's), every part with its minibatch_weights (share, advantage); one randperm per epoch, drawn in turn.

    All epochs are shuffled and weighted at once, per minibatch segment of the shuffled batches, and every minibatch
    is a view of them: per minibatch, no op runs here at all and per epoch none either (on small networks each op's
    fixed cost is what an update's time is made of). Each segment's sums run over its rows in order, as they would
    for that minibatch alone, so the numbers are those of one epoch at a time.
    """
    size = data["valid"].shape[0]
    device = data["valid"].device
    orders = [torch.randperm(size, device=device) for _ in range(epochs)]
    order = orders[0] if epochs == 1 else torch.cat(orders)
    shuffled = {key: value[order] for key, value in data.items()}
    bounds = [size // num_minibatches + (i < size % num_minibatches) for i in range(num_minibatches)] * epochs
    segments = len(bounds)
    # segment[i]: the minibatch that row i of the shuffled batches belongs to; per-minibatch sums are index_adds
    segment = torch.repeat_interleave(torch.arange(segments, device=device), torch.tensor(bounds, device=device))
    valid = shuffled["valid"].float()
    sums = torch.zeros(segments, device=device)
    num_valid = sums.index_add(0, segment, valid)[segment]
    share = valid / num_valid.clamp(min=1)
    advantage = shuffled["advantage"]
    if normalize:  # as minibatch_weights: over each minibatch's valid entries, unbiased std, only with 2 or more
        mean = sums.index_add(0, segment, advantage * share)[segment]
        variance = sums.index_add(0, segment, (advantage - mean).square() * share)[segment]
        std = (variance * num_valid / (num_valid - 1).clamp(min=1)).sqrt()
        advantage = torch.where(num_valid > 1, (advantage - mean) / (std + 1e-8), advantage)
    parts = {key: value.split(bounds) for key, value in shuffled.items()}
    minibatches = [
        (dict(zip(parts, fields)), part_share, part_advantage)
        for *fields, part_share, part_advantage in zip(*parts.values(), share.split(bounds), advantage.split(bounds))
    ]
    return [minibatches[start : start + num_minibatches] for start in range(0, segments, num_minibatches)]


class PPOUpdateTail:
    """What a PPO update does around its minibatch steps, shared by PPO and RecurrentPPO (which differ in how a
    minibatch is formed and replayed): the annealed learning rate and clip coefficient, the early stop on the
    trainer group's approx_kl, the update's metrics, and the optimizer's state. Uses self.cfg (a PPOConfig),
    self.context, self.optimizer."""

    cfg: PPOConfig  # these three: set by the algorithm that mixes this in
    context: Context
    optimizer: torch.optim.Optimizer

    def annealed(self, iteration: int) -> tuple[float, float]:
        """(learning rate, clip coefficient) for a 0-based iteration: linear decay towards 0 when annealing."""
        remaining = 1.0 - iteration / self.context.num_iterations
        lr = self.cfg.learning_rate * (remaining if self.cfg.anneal_lr else 1.0)
        clip = self.cfg.clip_coef * (remaining if self.cfg.anneal_clip else 1.0)
        return lr, clip

    def start_update(self, iteration: int) -> tuple[float, float]:
        """The iteration's (learning rate, clip coefficient), the learning rate set in the optimizer."""
        lr, clip = self.annealed(iteration)
        for param_group in self.optimizer.param_groups:
            param_group["lr"] = lr
        return lr, clip

    def stops_early(self, approx_kl: Tensor) -> bool:
        """algo.target_kl: whether the update stops before this minibatch's step (as SB3: no step on a minibatch
        whose policy already moved too far), decided on the trainer group's mean so every trainer stops alike."""
        return self.cfg.target_kl is not None and self._group_mean(approx_kl) > 1.5 * self.cfg.target_kl

    def update_metrics(self, steps: list[Tensor], data: dict[str, Tensor], lr: float, clip: float) -> dict[str, float]:
        """The losses averaged over every minibatch step taken (SB3 averages the same way), explained_variance of
        the rollout values, learning_rate, clip_coef and minibatch_steps."""
        means = torch.stack(steps).mean(0).tolist() if steps else [float("nan")] * len(LOSS_NAMES)
        metrics = dict(zip(LOSS_NAMES, means))
        valid = data["valid"]
        metrics["explained_variance"] = explained_variance(data["value"][valid], data["return_"][valid])
        metrics["learning_rate"] = lr
        metrics["clip_coef"] = clip
        metrics["minibatch_steps"] = float(len(steps))
        return metrics

    def _group_mean(self, value: Tensor) -> float:
        """The trainer group's mean of a scalar, so every trainer makes the same early-stop decision."""
        value = value.detach().clone().reshape(1)
        return float(self.context.all_reduce(value, f"{type(self).__name__} target_kl: approx_kl", mean=True))

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])


class PPO(PPOUpdateTail, Algorithm[PPOConfig]):
    """Owns the optimizer and runs the PPO update on this trainer's share of the batch.

    With several trainers, forward/backward go through the policy's DDP wrapper, so gradients are averaged over
    the trainer group. Every trainer then must take the same number of optimizer steps: the target_kl early stop
    is decided on the group's mean approx_kl. Each trainer's losses are means over its own valid entries, and DDP
    averages the trainers' gradients.

    Needs from the policy: per-step outputs log_prob and value, `evaluate(obs, action) -> (log_prob, entropy,
    value)` with gradients (also as forward(), for DDP) and `value(obs)` (declared in policy_methods: the contract
    calls each before start).
    """

    Config = PPOConfig
    requires = ("log_prob", "value")
    supports_action_chunks = True  # GAE over decisions (chunk_discounts); a chunk's log-prob is the policy's
    policy_methods = (
        PolicyMethod("evaluate", ("obs", "action"), ("log_prob", "entropy", "value"), "with gradients"),
        PolicyMethod("value", ("obs",), "value", "V(obs), for the bootstrap after the rollout's last step"),
        loss_forward("PPO's loss", "self.evaluate(obs, action)"),
    )

    @classmethod
    def schedule(cls, config: PPOConfig) -> Schedule:
        # On-policy without V-trace; with it, a few versions of lag (its truncated weights cut a staler signal).
        return Schedule(max_policy_lag=VTRACE_MAX_POLICY_LAG if config.vtrace else 0)

    @classmethod
    def check_plan(cls, config: PPOConfig, plan: PlanFacts) -> None:
        check_lag_without_vtrace(config, plan)
        if config.vtrace and plan.action_chunk > 1:
            raise UserError(
                f"algo.vtrace with env.action_chunk={plan.action_chunk} is not supported (V-trace discounts per "
                f"step); set algo.vtrace=false or env.action_chunk=1"
            )
        check_num_minibatches(config.num_minibatches, plan.samples_per_trainer, "samples a trainer holds")

    @classmethod
    def summary(cls, config: PPOConfig, plan: PlanFacts) -> str:
        per_trainer = plan.samples_per_trainer
        parts = f" in micro-batches of {config.micro_batch_size}" if config.micro_batch_size else ""
        return (
            f"batch {per_trainer * plan.trainer_ranks} ({per_trainer} per trainer), {config.num_minibatches} "
            f"minibatch(es) of {per_trainer // config.num_minibatches} per trainer{parts}, "
            f"{config.update_epochs} epochs"
        )

    @classmethod
    def takes_policy_on_meta(cls, config: PPOConfig) -> bool:
        return True  # data_parallel first, then only the parameters' list

    def __init__(self, policy: Policy, config: PPOConfig, context: Context):
        super().__init__(policy, config, context)
        self.cfg = config
        # The module forward/backward go through: the DDP wrapper (grads averaged over trainers) or the policy.
        self.model = context.data_parallel(policy)
        # Trainable only: a frozen parameter (requires_grad False) gets no gradient and no optimizer state.
        self.parameters = [param for param in policy.parameters() if param.requires_grad]
        # fused: one kernel over all parameters instead of a dozen small ops per tensor (about 4x faster on CPU).
        self.optimizer = torch.optim.Adam(self.parameters, lr=config.learning_rate, eps=1e-5, fused=True)
        self.adam_step = FusedAdamStep(self.optimizer)  # optimizer.step() without its wrapper, once per minibatch

    def learn(self, segment: TensorDict, iteration: int) -> dict[str, float]:
        """GAE over the rollout, the clipped-surrogate update, then the observation statistics."""
        rollout = segment["rollout"].to(self.context.device)
        cfg = self.cfg
        with torch.no_grad():
            next_value = self.policy.value(segment["next_obs"].to(self.context.device))
        if cfg.vtrace:
            targets = self.vtrace_targets(rollout, next_value)
        else:
            targets = gae_targets(rollout, next_value, cfg)
        batch = learner_batch(rollout, *targets).reshape(-1)
        metrics = self.update(batch, iteration)
        # The statistics used to collect this rollout stay fixed while learning from it; fold the rollout's
        # observations in afterwards, so the next rollout (and its learning) use the merged statistics.
        self.policy.update_normalizer(batch["obs"][batch["valid"]], self.context)
        return metrics

    def vtrace_targets(self, rollout: TensorDict, next_value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(advantage, return_, value) by V-trace: the learner's current policy is the target pi, the rollout's
        log_prob (what the acting weights gave) the behaviour mu, and the learner's values the baseline. The
        clipped surrogate's ratio stays relative to the behaviour log-probs."""
        cfg = self.cfg
        flat = rollout.reshape(-1)
        with torch.no_grad():
            target_log_prob, _, value = self.policy.evaluate(flat["obs"], flat["action"])
        target_log_prob = target_log_prob.reshape(rollout.batch_size)
        value = value.reshape(rollout.batch_size)
        return vtrace_targets_from(rollout, target_log_prob, value, next_value, cfg)

    def update(self, batch: TensorDict, iteration: int) -> dict[str, float]:
        """One PPO update on a flat batch [B] with keys obs, action, log_prob, advantage, return_, value, valid.

        Returns the losses averaged over every minibatch step taken in all epochs (SB3 averages the same way),
        plus explained_variance of the rollout values, learning_rate, clip_coef and minibatch_steps (fewer than
        update_epochs * num_minibatches when target_kl stopped the update early).
        """
        cfg = self.cfg
        lr, clip = self.start_update(iteration)
        data = rollout_tensors(batch)
        coefficients = loss_coefficients(cfg).to(self.context.device)

        epochs = self.epoch_schedule(data)

        steps: list[Tensor] = []  # each step's LOSS_NAMES values, read once after the update (no per-step sync)
        stopped = False
        for minibatches in epochs:
            for minibatch, share, advantage in minibatches:
                if 0 < cfg.micro_batch_size < share.shape[0]:  # algo.micro_batch_size: the same step, in parts
                    losses = self.step_in_parts(minibatch, share, advantage, clip, coefficients)
                    if losses is None:
                        stopped = True
                        break
                    steps.append(losses)
                    continue
                new_log_prob, entropy, new_value = self.model(minibatch["obs"], minibatch["action"])
                losses = clipped_losses(minibatch, share, advantage, new_log_prob, entropy, new_value, clip, cfg)
                if self.stops_early(losses[APPROX_KL]):
                    stopped = True
                    break
                for param in self.parameters:  # zero_grad(set_to_none=True), without its per-call bookkeeping
                    param.grad = None
                (losses @ coefficients).backward()
                clip_grad_norm(self.parameters, self.cfg.max_grad_norm)
                self.adam_step()
                steps.append(losses.detach())
            if stopped:
                break

        return self.update_metrics(steps, data, lr, clip)

    def step_in_parts(
        self, minibatch: dict[str, Tensor], share: Tensor, advantage: Tensor, clip: float, coefficients: Tensor
    ) -> Tensor | None:
        """One minibatch step with algo.micro_batch_size: gradients_in_parts, then the clip and optimizer step
        of the whole minibatch. Returns its LOSS_NAMES values, or None when target_kl stops the update (decided,
        as without parts, on the whole minibatch's approx_kl: known only after the parts' backward, whose
        gradients are then dropped without a step)."""
        losses = self.gradients_in_parts(minibatch, share, advantage, clip, coefficients)
        if self.stops_early(losses[APPROX_KL]):
            for param in self.parameters:
                param.grad = None
            return None
        clip_grad_norm(self.parameters, self.cfg.max_grad_norm)
        self.adam_step()
        return losses

    def gradients_in_parts(
        self, minibatch: dict[str, Tensor], share: Tensor, advantage: Tensor, clip: float, coefficients: Tensor
    ) -> Tensor:
        """The minibatch's gradients left in .grad, its forward and backward run in parts of at most
        algo.micro_batch_size samples; returns its LOSS_NAMES values [5] (the whole minibatch's means).

        share and advantage come from the whole minibatch, so each part's clipped_losses is its own share of every
        mean: the parts' losses, and their gradients, sum to the whole minibatch's. With DDP the gradients are
        averaged over the trainers once, in the last part's backward."""
        for param in self.parameters:
            param.grad = None
        total = torch.zeros(len(LOSS_NAMES), device=share.device)
        starts = range(0, share.shape[0], self.cfg.micro_batch_size)
        for start in starts:
            rows = slice(start, start + self.cfg.micro_batch_size)
            part = {key: value[rows] for key, value in minibatch.items()}
            with gradient_sync(self.model, start == starts[-1]):
                new_log_prob, entropy, new_value = self.model(part["obs"], part["action"])
                losses = clipped_losses(
                    part, share[rows], advantage[rows], new_log_prob, entropy, new_value, clip, self.cfg
                )
                (losses @ coefficients).backward()
            total += losses.detach()
        return total

    def epoch_schedule(self, data: dict[str, Tensor]) -> Iterable[list[tuple[dict[str, Tensor], Tensor, Tensor]]]:
        """Each epoch's minibatches with their weights (share, advantage)."""
        cfg = self.cfg
        if cfg.num_minibatches == 1:  # the same minibatch every epoch, its weights computed once
            whole_batch = (data, *minibatch_weights(data["valid"], data["advantage"], cfg.normalize_advantages))
            return itertools.repeat([whole_batch], cfg.update_epochs)
        if cfg.target_kl is None:  # every epoch runs: all epochs' shuffles at once, the same draws in the same order
            return shuffled_minibatches(data, cfg.num_minibatches, cfg.normalize_advantages, cfg.update_epochs)
        # An early stop leaves the later epochs' shuffles undrawn (the random numbers after it stay as they were).
        return (
            shuffled_minibatches(data, cfg.num_minibatches, cfg.normalize_advantages)[0]
            for _ in range(cfg.update_epochs)
        )
