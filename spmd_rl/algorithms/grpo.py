"""GRPO (group relative policy optimization), as SimpleVLA-RL and RLinf fine-tune VLA policies (`algo.class: grpo`).

Read top to bottom: outcomes of whole episodes, group-relative advantages (and dynamic sampling), then PPO's
clipped objective with clip-higher and an optional KL to the initial (reference) policy. No value function: a group of
env.group_size envs starts from one initial state (docs/envs.md), and each episode is judged against its group's.

A rollout is whole episodes (Schedule(rollout_unit="episode")): every env starts from a reset, and rollout["active"]
marks the decisions of the episode each env column ran; the column's outcome is its episode's success (an env that
reports a success flag, or algo.outcome=success) or its return (algo.outcome=return, or an env without the flag).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tensordict import TensorDict
from torch import Tensor, nn

from spmd_rl.algorithms.configs import GRPOConfig, check_num_minibatches
from spmd_rl.algorithms.optimizer_step import FusedAdamStep, clip_grad_norm
from spmd_rl.algorithms.targets import local_view, trainable_values, values_swapped
from spmd_rl.comm.sharding import is_dtensor
from spmd_rl.interfaces.algorithm import UNLEARNED_VALUE, Algorithm, PlanFacts, Schedule, loss_forward
from spmd_rl.interfaces.context import Context
from spmd_rl.interfaces.policy import ACTIVE, CHUNK_VALID, SUCCESS_FIELDS, Policy
from spmd_rl.runtime.errors import UserError

# ---------------------------------------------------------------------------------------------------------------
# Outcomes and advantages


def episode_returns(rollout: TensorDict) -> Tensor:
    """Each env column's return [N] in the episode it ran in this rollout (its active decisions' rewards; with
    action chunks, the rewards of the steps that ran)."""
    reward = rollout["reward"]
    if CHUNK_VALID in rollout.keys():
        reward = (reward * rollout[CHUNK_VALID]).sum(-1)
    return (reward * rollout[ACTIVE]).sum(0)


def episode_successes(rollout: TensorDict) -> Tensor:
    """Each env column's success [N] (1.0 or 0.0) in the episode it ran in this rollout: whether the env's success
    flag was set at any of its steps, as the env side records it at the decision that ends the episode (a rollout
    of whole episodes is long enough for every episode to end in it)."""
    return (rollout["episode_success"] & rollout[ACTIVE]).any(0).float()


def success_outcome(outcome: str, rollout_keys) -> bool:
    """Whether algo.outcome judges episodes by success: asked for, or (auto) where the env reports a success flag."""
    return outcome == "success" or (outcome == "auto" and "episode_success" in rollout_keys)


def group_advantages(outcome: Tensor, group_size: int, std_eps: float, filter_groups: bool) -> tuple[Tensor, Tensor]:
    """(advantage [N], kept [N]): (R - mean_group) / (std_group + std_eps) for every env column of a group of
    group_size consecutive columns (std unbiased); with filter_groups, a group whose outcomes are all equal is not
    kept (its advantages are 0 anyway: it carries no signal, only dilutes the batch)."""
    groups = outcome.reshape(-1, group_size)
    mean = groups.mean(1, keepdim=True)
    std = groups.std(1, keepdim=True)
    informative = (groups != groups[:, :1]).any(1)
    # A flat group's advantages are 0 (0 / std_eps), also with std_eps 0 (not 0 / 0).
    advantage = torch.where(informative[:, None], (groups - mean) / (std + std_eps), 0.0).reshape(-1)
    kept = informative if filter_groups else torch.ones_like(informative)
    return advantage, kept.repeat_interleave(group_size)


@dataclass(frozen=True)
class JudgedRollout:
    """A rollout's env columns with each one's outcome and advantage, and whether its group is kept."""

    rollout: TensorDict  # [T, N]
    outcome: Tensor  # [N]
    advantage: Tensor  # [N]
    kept: Tensor  # [N], bool

    def kept_columns(self) -> JudgedRollout:
        """The columns of the kept groups alone (what an extra round adds to the batch)."""
        kept = self.kept
        return JudgedRollout(self.rollout[:, kept], self.outcome[kept], self.advantage[kept], kept[kept])

    def totals(self) -> Tensor:
        """(the outcomes' sum, the columns, the columns dropped), float64: what the metrics add up."""
        columns = self.outcome.new_tensor(self.kept.numel())
        return torch.stack([self.outcome.sum(), columns, (~self.kept).sum().to(columns.dtype)]).double()

    def decisions(self) -> dict[str, Tensor]:
        """Decision by decision ([T * N]): the observation, the action, its log-prob when acting, the advantage, and
        whether it is learned from (an active decision of a kept group)."""
        learned = self.rollout["valid"] & self.rollout[ACTIVE] & self.kept
        decisions = self.rollout.reshape(-1)
        return {
            "obs": decisions["obs"],
            "action": decisions["action"],
            "old_log_prob": decisions["log_prob"],
            "advantage": self.advantage.expand_as(learned).reshape(-1),
            "learned": learned.reshape(-1),
        }


# ---------------------------------------------------------------------------------------------------------------
# Objective


def grpo_losses(
    log_prob: Tensor,
    old_log_prob: Tensor,
    ref_log_prob: Tensor | None,
    entropy: Tensor,
    advantage: Tensor,
    weight: Tensor,
    cfg: GRPOConfig,
) -> dict[str, Tensor]:
    """The clipped surrogate with clip-higher, the k3 KL to the reference policy and the entropy, each a weighted
    sum over decisions (weight: 1 / the decisions kept over all trainers, 0 for those not learned from)."""
    log_ratio = log_prob - old_log_prob
    ratio = log_ratio.exp()
    clipped_ratio = ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high)
    surrogate = torch.min(advantage * ratio, advantage * clipped_ratio)
    losses = {"policy_loss": -(surrogate * weight).sum(), "entropy": (entropy * weight).sum()}
    if ref_log_prob is not None:  # k3: exp(ref - new) - (ref - new) - 1, unbiased and never negative
        ref_log_ratio = ref_log_prob - log_prob
        losses["kl_ref"] = ((ref_log_ratio.exp() - ref_log_ratio - 1) * weight).sum()
    with torch.no_grad():
        losses["approx_kl"] = ((ratio - 1 - log_ratio) * weight).sum()
        losses["clip_fraction"] = ((ratio != clipped_ratio).float() * weight).sum()
    return losses


class GRPO(Algorithm):
    """Group-relative advantages over whole episodes, PPO's clipped objective (clip_low / clip_high), an optional
    KL to the frozen initial policy. Needs env.group_size >= 2; takes action chunks (a chunk's log-prob is the
    policy's, summed over the chunk)."""

    Config = GRPOConfig
    requires = ("log_prob",)
    supports_action_chunks = True
    policy_methods = (loss_forward("GRPO", UNLEARNED_VALUE),)

    @classmethod
    def schedule(cls, config: GRPOConfig) -> Schedule:
        return Schedule(rollout_unit="episode")

    @classmethod
    def required_fields(cls, config: GRPOConfig) -> tuple[str, ...]:
        # algo.outcome=success needs the env's success flag (exit 2 before start naming env.success_key without it)
        return cls.requires + (tuple(SUCCESS_FIELDS) if config.outcome == "success" else ())

    @classmethod
    def check_plan(cls, config: GRPOConfig, plan: PlanFacts) -> None:
        if plan.group_size < 2:
            raise UserError(
                "algo.class grpo compares each episode with its group's: set env.group_size to 2 or more (e.g. 8)"
            )
        if config.max_resample_rounds and not config.filter_groups:
            raise UserError(
                f"algo.max_resample_rounds={config.max_resample_rounds} refills the groups algo.filter_groups drops: "
                f"set algo.filter_groups=true, or algo.max_resample_rounds=0"
            )
        if config.max_resample_rounds and not plan.colocated:
            raise UserError(
                f"algo.max_resample_rounds={config.max_resample_rounds} rolls extra rollouts where the trainers "
                f"decide, which the split layout's env ranks cannot follow (their schedule is the plan's alone): set "
                f"layout.mode=colocated (or run in one process), or algo.max_resample_rounds=0"
            )
        if plan.asked_policy_lag:
            raise UserError(
                f"algo.class grpo learns on-policy; the engine asks for a policy lag of {plan.asked_policy_lag}: "
                f"lower it to 0"
            )
        check_num_minibatches(config.num_minibatches, plan.samples_per_trainer, "decisions a trainer holds")

    @classmethod
    def summary(cls, config: GRPOConfig, plan: PlanFacts) -> str:
        rounds = config.max_resample_rounds
        return (
            f"GRPO over groups of {plan.group_size}, clip {config.clip_low}/{config.clip_high}, "
            f"{config.update_epochs} epoch(s) of {config.num_minibatches} minibatch(es)"
            f"{', groups with equal outcomes dropped' if config.filter_groups else ''}"
            f"{f' and refilled by up to {rounds} extra rollouts' if rounds else ''}"
        )

    @classmethod
    def takes_policy_on_meta(cls, config: GRPOConfig) -> bool:
        return True  # the KL's reference is taken from the policy once laid out (and given its values)

    def __init__(self, policy: Policy, config: GRPOConfig, context: Context):
        super().__init__(policy, config, context)
        self.cfg = config
        self.group_size = context.group_size
        self.model = context.data_parallel(policy)
        self.parameters = [param for param in policy.parameters() if param.requires_grad]
        # The KL's reference policy is the initial one: the initial values of the trainable parameters (the frozen
        # ones never change), each as this trainer holds it (its shards under fsdp), by name. Its log-probs are the
        # policy's own forward with them swapped in (_reference_log_prob). Saved in checkpoints, so a resumed run
        # keeps comparing with the same weights.
        self.reference = trainable_values(policy) if config.kl_coef > 0 else None
        self.optimizer = torch.optim.Adam(self.parameters, lr=config.learning_rate, eps=1e-5, fused=True)
        self.adam_step = FusedAdamStep(self.optimizer)

    def learn(self, segment: TensorDict, iteration: int) -> dict[str, float]:
        cfg, device = self.cfg, self.context.device

        # 1. Each episode's outcome, and its advantage within its group; dynamic sampling drops flat groups, and with
        #    algo.max_resample_rounds rolls more rollouts (their informative groups only) until the batch holds as
        #    many groups as one rollout has, or the rounds run out.
        rounds = [self._judged(segment["rollout"].to(device))]
        while self._refill_needed(rounds):
            rounds.append(self._judged(self._extra_rollout(iteration).to(device)))
        batch = [rounds[0], *(judged.kept_columns() for judged in rounds[1:])]

        # 2. Every decision of an episode gets the episode's advantage; only its active decisions are learned from.
        parts = [judged.decisions() for judged in batch]
        flat = {key: torch.cat([part[key] for part in parts]) for key in parts[0]}
        if self.reference is not None:
            with torch.no_grad():
                flat["ref_log_prob"] = self._reference_log_prob(flat["obs"], flat["action"])

        # 3. The clipped objective over minibatches, each decision weighted 1 / (decisions learned from in the
        #    minibatch over all trainers): DDP's average over trainers then weighs every decision alike, however
        #    many each trainer kept.
        steps = []
        for _ in range(cfg.update_epochs):
            order = torch.randperm(flat["learned"].numel(), device=device)
            for rows in order.tensor_split(cfg.num_minibatches):
                steps.append(self._step({key: value[rows] for key, value in flat.items()}))

        # 4. Metrics: the losses' means over the steps taken, the outcomes and the share of groups dropped (over every
        #    round), the extra rounds and their env steps.
        taken = [step for step in steps if step]
        metrics = {key: float(torch.stack([step[key] for step in taken]).mean()) for key in (taken[:1] or [{}])[0]}
        metrics["minibatch_steps"] = float(len(taken))
        totals = torch.stack([judged.totals() for judged in rounds]).sum(0)
        outcome_sum, columns, dropped = self.context.all_reduce(totals, "GRPO outcomes").tolist()
        metrics["outcome_mean"] = outcome_sum / columns
        metrics["dropped_group_fraction"] = dropped / columns
        metrics["resample_rounds"] = float(len(rounds) - 1)
        metrics["resampled_env_steps"] = float((len(rounds) - 1) * self.context.steps_per_iteration)
        metrics["learning_rate"] = cfg.learning_rate
        return metrics

    def _judged(self, rollout: TensorDict) -> JudgedRollout:
        cfg = self.cfg
        success = success_outcome(cfg.outcome, rollout.keys())
        outcome = episode_successes(rollout) if success else episode_returns(rollout)
        advantage, kept = group_advantages(outcome, self.group_size, cfg.std_eps, cfg.filter_groups)
        return JudgedRollout(rollout, outcome, advantage, kept)

    def _refill_needed(self, rounds: list[JudgedRollout]) -> bool:
        """Whether to roll one more round: rounds are left and the groups kept so far, over all trainers, are fewer
        than one rollout's. Every trainer computes the same answer (one all_reduce), so all roll alike."""
        if len(rounds) > self.cfg.max_resample_rounds:
            return False
        kept = sum(float(judged.kept.sum()) for judged in rounds)
        counts = torch.tensor([kept, rounds[0].kept.numel()], dtype=torch.float64, device=self.context.device)
        kept_columns, rollout_columns = self.context.all_reduce(counts, "GRPO groups kept").tolist()
        return kept_columns < rollout_columns

    def _extra_rollout(self, iteration: int) -> TensorDict:
        """One more rollout of this trainer's envs, from the engine (Context.extra_rollout)."""
        extra_rollout = self.context.extra_rollout
        if extra_rollout is None:
            raise UserError(
                f"algo.max_resample_rounds={self.cfg.max_resample_rounds}: this engine does not roll extra rollouts "
                f"within an iteration (the built-in sync engine does, in one process and the colocated layout); set "
                f"algo.max_resample_rounds=0"
            )
        return extra_rollout(iteration)["rollout"]

    def _reference_log_prob(self, obs: Tensor, action: Tensor) -> Tensor:
        """The reference policy's log-prob of each action: the policy's forward (not DDP's wrapper: no gradient to
        sync) with the reference values in its trainable parameters, its buffers (GRPO never updates a normalizer)
        and frozen parameters as they are; under fsdp the shards swapped in are all-gathered as for any forward."""
        assert self.reference is not None
        with values_swapped(self.policy, self.reference):
            return self.policy(obs, action)[0]

    def _step(self, minibatch: dict[str, Tensor]) -> dict[str, Tensor]:
        """One optimizer step on a minibatch; {} when no trainer learns from any of its decisions (all agree)."""
        cfg = self.cfg
        count = minibatch["learned"].sum().double().reshape(1)
        total = float(self.context.all_reduce(count, "GRPO decisions per minibatch"))
        if total == 0:
            return {}
        weight = minibatch["learned"].float() * (self.context.num_trainers / total)
        log_prob, entropy, value = self.model(minibatch["obs"], minibatch["action"])
        losses = grpo_losses(
            log_prob,
            minibatch["old_log_prob"],
            minibatch.get("ref_log_prob"),
            entropy,
            minibatch["advantage"],
            weight,
            cfg,
        )
        loss = losses["policy_loss"] - cfg.ent_coef * losses["entropy"] + cfg.kl_coef * losses.get("kl_ref", 0.0)
        # The value output takes no part, but DDP expects a gradient for every parameter that took part in forward.
        loss = loss + 0.0 * value.sum()
        for param in self.parameters:
            param.grad = None
        loss.backward()
        clip_grad_norm(self.parameters, cfg.max_grad_norm)
        self.adam_step()
        # This trainer's part of each mean, scaled as its gradient is: the trainers' average is the global mean.
        return {key: value.detach() for key, value in losses.items()}

    def state_dict(self) -> dict:
        state = {"optimizer": self.optimizer.state_dict()}
        if self.reference is not None:
            state["reference"] = dict(self.reference)  # DTensors under fsdp: the checkpoint's shard files
        return state

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        if self.reference is not None:
            load_reference(self.reference, state["reference"], self.policy)


@torch.no_grad()
def load_reference(reference: dict[str, Tensor], stored: dict, policy: nn.Module) -> None:
    """The saved reference values into `reference`: the same tensors (DTensors read from the shard files, laid out
    over this run's trainers), or from a checkpoint written before the reference was values, the whole reference
    policy's state dict, of which the trainable parameters' entries are taken (under fsdp this trainer's rows)."""
    if not set(reference) <= set(stored):  # a state dict in the layout the policy saves (ActorCritic's pair)
        stored = parameter_layout(policy, stored)
    for name, value in reference.items():
        saved = stored[name]
        if is_dtensor(value):
            from torch.distributed.tensor import distribute_tensor

            mesh, placements = value.device_mesh, value.placements
            if not is_dtensor(saved):  # each trainer takes its own rows of the whole tensor, no communication
                saved = distribute_tensor(saved.to(value.device), mesh, placements, src_data_rank=None)
            elif saved.placements != placements:
                saved = saved.redistribute(mesh, placements)
        local_view(value).copy_(local_view(saved))


def parameter_layout(module: nn.Module, state: dict) -> dict:
    """A copy of state, a state dict as module.state_dict() writes it, keyed by module's parameter names: what the
    module's load_state_dict pre-hooks make of it (a policy that saves its parameters in another layout converts
    them there), run as load_state_dict runs them, parent first, without loading anything."""
    state = dict(state)
    for prefix, sub in module.named_modules():
        for hook in sub._load_state_dict_pre_hooks.values():  # torch keeps them there (no public accessor)
            hook(state, f"{prefix}." if prefix else "", {}, True, [], [], [])
    return state
