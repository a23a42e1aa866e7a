"""PPO for recurrent policies, with truncated backpropagation through time over each segment's sequences
(`algo.class: spmd_rl.algorithms.recurrent_ppo:RecurrentPPO`).

What differs from PPO (algorithms/ppo.py, whose advantage and loss functions this reuses):
- the policy is replayed over whole sequences: every env column of the segment [T, N] is one sequence of T steps,
  started from the state its first step acted from (segment["recurrent_state"]) and reset wherever an episode
  starts inside it (rollout["episode_start"]), exactly as acting did; gradients flow back through the T steps of
  the segment and no further (truncated BPTT);
- minibatches are sets of whole env columns (a column cut in pieces would lose the state between its pieces);
- the bootstrap value V(next_obs) comes from the state after the segment's last step.
With the policy unchanged, the replay gives the log-probs acting gave, so the first epoch's ratio is 1.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar

import torch
from tensordict import TensorDict
from torch import Tensor

from spmd_rl.algorithms.configs import PPOConfig, check_num_minibatches
from spmd_rl.algorithms.optimizer_step import clip_grad_norm
from spmd_rl.algorithms.ppo import (
    APPROX_KL,
    LOSS_NAMES,
    VTRACE_MAX_POLICY_LAG,
    PPOUpdateTail,
    check_lag_without_vtrace,
    clipped_losses,
    gae_targets,
    gradient_sync,
    learner_batch,
    minibatch_weights,
    ppo_losses,
    rollout_tensors,
    total_loss,
    vtrace_targets_from,
)
from spmd_rl.config.sections import knob
from spmd_rl.interfaces.algorithm import Algorithm, PlanFacts, Schedule
from spmd_rl.interfaces.context import Context
from spmd_rl.interfaces.policy import EPISODE_START, RECURRENT_STATE, Policy


@dataclass
class RecurrentPPOConfig(PPOConfig):
    """PPO's keys; num_minibatches splits each trainer's env columns (whole sequences), not its steps."""

    default_policy: ClassVar[str] = "spmd_rl.modules.recurrent:RecurrentActorCritic"
    micro_batch_size: int = knob(
        0,
        "run each minibatch's replay and backward in parts of at most this many whole sequences (env columns), "
        "gradients accumulated, then one clip and optimizer step (0 = the whole minibatch)",
        min=0,
        omit_default=True,
    )


def column_minibatches(columns: int, num_minibatches: int, device) -> Iterator[Tensor]:
    """The env columns split into num_minibatches random sets (sizes differ by at most one)."""
    if num_minibatches == 1:
        yield torch.arange(columns, device=device)
        return
    yield from torch.randperm(columns, device=device).tensor_split(num_minibatches)


class RecurrentPPO(PPOUpdateTail, Algorithm[RecurrentPPOConfig]):
    """The clipped-surrogate update over sequences of a recurrent policy.

    Needs from the policy: a recurrent state (`recurrent_state()`), per-step outputs log_prob and value,
    `evaluate_sequence(obs, action, episode_start, state) -> (log_prob, entropy, value)` each [T, B] with gradients
    through time (also as forward(), which DDP wraps), and `value_sequence(obs, episode_start, state) -> [T, B]`.
    See spmd_rl/modules/recurrent.py."""

    Config = RecurrentPPOConfig
    requires = ("log_prob", "value", EPISODE_START, RECURRENT_STATE)
    policy_methods = ("evaluate_sequence", "value_sequence", "forward")

    @classmethod
    def schedule(cls, config: RecurrentPPOConfig) -> Schedule:
        return Schedule(max_policy_lag=VTRACE_MAX_POLICY_LAG if config.vtrace else 0)

    @classmethod
    def check_plan(cls, config: RecurrentPPOConfig, plan: PlanFacts) -> None:
        check_lag_without_vtrace(config, plan)
        columns = plan.samples_per_trainer // config.num_steps
        what = "env columns (whole sequences) a trainer learns from"
        check_num_minibatches(config.num_minibatches, columns, what, advice="lower it or raise env.num_envs")

    @classmethod
    def summary(cls, config: RecurrentPPOConfig, plan: PlanFacts) -> str:
        columns = plan.samples_per_trainer // config.num_steps
        return (
            f"batch {plan.steps_per_iteration} ({columns} sequences of {config.num_steps} steps per trainer), "
            f"{config.num_minibatches} minibatch(es) of {columns // config.num_minibatches} sequences, "
            f"{config.update_epochs} epochs"
        )

    def __init__(self, policy: Policy, config: RecurrentPPOConfig, context: Context):
        super().__init__(policy, config, context)
        self.cfg = config
        self.model = context.data_parallel(policy)  # forward = evaluate_sequence, grads averaged over trainers
        self.parameters = [param for param in policy.parameters() if param.requires_grad]  # frozen ones: no state
        self.optimizer = torch.optim.Adam(self.parameters, lr=config.learning_rate, eps=1e-5)

    def learn(self, segment: TensorDict, iteration: int) -> dict[str, float]:
        device = self.context.device
        rollout = segment["rollout"].to(device)
        state = {name: value.to(device) for name, value in segment[RECURRENT_STATE].items()}
        starts = rollout[EPISODE_START]
        cfg = self.cfg
        with torch.no_grad():
            # V(next_obs) from the state after the last step: replay the segment one step further. next_obs
            # starts an episode where the last step was a reset step (invalid), as the env runner marks it.
            obs_and_next = torch.cat([rollout["obs"], segment["next_obs"].to(device).unsqueeze(0)])
            starts_and_next = torch.cat([starts, ~rollout["valid"][-1:]])
            next_value = self.policy.value_sequence(obs_and_next, starts_and_next, state)[-1]
        if cfg.vtrace:
            targets = self.vtrace_targets(rollout, state, next_value)
        else:
            targets = gae_targets(rollout, next_value, cfg)
        metrics = self.update(learner_batch(rollout, *targets), starts, state, iteration)
        valid = rollout["valid"]
        self.policy.update_normalizer(rollout["obs"][valid], self.context)
        return metrics

    def vtrace_targets(self, rollout: TensorDict, state: dict, next_value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """As PPO's: the learner's replay of the sequences is the target policy, the rollout's log_prob the
        behaviour policy."""
        cfg = self.cfg
        with torch.no_grad():
            target_log_prob, _, value = self.policy.evaluate_sequence(
                rollout["obs"], rollout["action"], rollout[EPISODE_START], state
            )
        return vtrace_targets_from(rollout, target_log_prob, value, next_value, cfg)

    def update(self, batch: TensorDict, starts: Tensor, state: dict, iteration: int) -> dict[str, float]:
        """Epochs of minibatches of whole env columns [T, b]: replay each from its first state, then PPO's losses
        over its T * b steps."""
        cfg = self.cfg
        lr, clip = self.start_update(iteration)
        data = rollout_tensors(batch)  # [T, N] each, targets of reset steps zeroed
        columns = starts.shape[1]

        steps: list[Tensor] = []
        self.first_ratio = None  # the first minibatch's max |ratio - 1|: 0 up to rounding (tests check it)
        stopped = False
        for _ in range(cfg.update_epochs):
            for cols in column_minibatches(columns, cfg.num_minibatches, starts.device):
                if 0 < cfg.micro_batch_size < len(cols):  # algo.micro_batch_size: the same step, in parts
                    part_losses = self.step_in_parts(data, starts, state, cols, clip)
                    if part_losses is None:
                        stopped = True
                        break
                    steps.append(part_losses)
                    continue
                sequence = {key: value[:, cols] for key, value in data.items()}
                first = {name: value[cols] for name, value in state.items()}
                log_prob, entropy, value = self.model(sequence["obs"], sequence["action"], starts[:, cols], first)
                flat = {key: value.reshape(-1) for key, value in sequence.items() if key not in ("obs", "action")}
                losses = ppo_losses(flat, log_prob.reshape(-1), entropy.reshape(-1), value.reshape(-1), clip, cfg)
                if self.first_ratio is None:
                    with torch.no_grad():
                        ratio = (log_prob.reshape(-1) - flat["log_prob"]).exp()
                        self.first_ratio = float(((ratio - 1).abs() * flat["valid"]).max())
                if self.stops_early(losses["approx_kl"]):
                    stopped = True
                    break
                self.optimizer.zero_grad(set_to_none=True)
                total_loss(losses, cfg).backward()
                clip_grad_norm(self.parameters, cfg.max_grad_norm)
                self.optimizer.step()
                with torch.no_grad():
                    steps.append(torch.stack([losses[name] for name in LOSS_NAMES]))
            if stopped:
                break

        return self.update_metrics(steps, data, lr, clip)

    def step_in_parts(self, data: dict, starts: Tensor, state: dict, cols: Tensor, clip: float) -> Tensor | None:
        """One minibatch step with algo.micro_batch_size: gradients_in_parts, then the whole minibatch's clip and
        optimizer step. Its LOSS_NAMES values, or None when target_kl stops the update (its gradients dropped)."""
        cfg = self.cfg
        losses = self.gradients_in_parts(data, starts, state, cols, clip)
        if self.stops_early(losses[APPROX_KL]):
            self.optimizer.zero_grad(set_to_none=True)
            return None
        clip_grad_norm(self.parameters, cfg.max_grad_norm)
        self.optimizer.step()
        return losses

    def gradients_in_parts(self, data: dict, starts: Tensor, state: dict, cols: Tensor, clip: float) -> Tensor:
        """The gradients of the minibatch of env columns `cols`, left in .grad, replayed in parts of at most
        algo.micro_batch_size whole sequences; returns its LOSS_NAMES values (the whole minibatch's means).

        Each entry's share of the means and the normalized advantages come from the whole minibatch, so the parts'
        losses and gradients sum to the whole's. With DDP the last part's backward averages over the trainers."""
        cfg = self.cfg
        steps = starts.shape[0]
        valid, advantage = data["valid"][:, cols], data["advantage"][:, cols]
        share, advantage = minibatch_weights(valid.reshape(-1), advantage.reshape(-1), cfg.normalize_advantages)
        share, advantage = share.reshape(steps, -1), advantage.reshape(steps, -1)
        self.optimizer.zero_grad(set_to_none=True)
        total = torch.zeros(len(LOSS_NAMES), device=starts.device)
        measure_ratio, ratio_error = self.first_ratio is None, 0.0
        bounds = range(0, len(cols), cfg.micro_batch_size)
        for start in bounds:
            part = slice(start, start + cfg.micro_batch_size)
            part_cols = cols[part]
            sequence = {key: value[:, part_cols] for key, value in data.items()}
            first = {name: value[part_cols] for name, value in state.items()}
            with gradient_sync(self.model, start == bounds[-1]):
                log_prob, entropy, value = self.model(sequence["obs"], sequence["action"], starts[:, part_cols], first)
                flat = {key: value.reshape(-1) for key, value in sequence.items() if key not in ("obs", "action")}
                weights = (share[:, part].reshape(-1), advantage[:, part].reshape(-1))
                new = (log_prob.reshape(-1), entropy.reshape(-1), value.reshape(-1))
                losses = clipped_losses(flat, *weights, *new, clip, cfg)
                total_loss(dict(zip(LOSS_NAMES, losses.unbind())), cfg).backward()
            if measure_ratio:  # as the whole minibatch's: the largest |ratio - 1| over its valid entries
                with torch.no_grad():
                    ratio = (log_prob.reshape(-1) - flat["log_prob"]).exp()
                    ratio_error = max(ratio_error, float(((ratio - 1).abs() * flat["valid"]).max()))
            total += losses.detach()
        if measure_ratio:
            self.first_ratio = ratio_error
        return total
