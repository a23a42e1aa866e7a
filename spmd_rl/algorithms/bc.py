"""Behaviour cloning, the supervised fine-tuning (SFT) that VLA recipes run before RL (`algo.class: bc`).

Read top to bottom: each trainer reads its share of the demonstrations' episodes (algorithms/demonstrations.py),
then every iteration is algo.update_epochs passes over them in minibatches; a minibatch's loss is the negative
log-likelihood of the demonstrated actions under the policy: the Gaussian head's NLL, or the cross-entropy of a
discrete or binned head (policy.action_bins), an action chunk's summed over the actions that ran (chunk_valid: an
episode's end cuts a chunk short, and the file's actions past it are no demonstration). Every demonstrated action
weighs alike: a minibatch's loss is its decisions' summed NLL over its decision count, so a cut chunk counts by
its valid steps. Its checkpoint and policy.pt are what `run.init_from` starts PPO or GRPO from.

No rollouts (Schedule(rollout_unit="none")): the envs step only in evaluation (eval.every), which reports
eval_success_rate for envs with a success flag.
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from tensordict import TensorDict
from torch import Tensor

from spmd_rl.algorithms.configs import BCConfig
from spmd_rl.algorithms.demonstrations import check_files, demonstration_files, expected_layout, read_share
from spmd_rl.algorithms.optimizer_step import FusedAdamStep, clip_grad_norm
from spmd_rl.interfaces.algorithm import UNLEARNED_VALUE, Algorithm, PlanFacts, Schedule, loss_forward
from spmd_rl.interfaces.context import Context
from spmd_rl.interfaces.policy import CHUNK_VALID, Policy
from spmd_rl.runtime.errors import UserError


class BC(Algorithm):
    """The demonstrated actions' negative log-likelihood, minibatch SGD (Adam) over the demonstrations, each trainer
    on its own share of the episodes with an equal part of every minibatch (DDP or FSDP average the gradients)."""

    Config = BCConfig
    supports_action_chunks = True
    policy_methods = (
        loss_forward(
            "bc",
            f"{UNLEARNED_VALUE}; with action chunks also forward(obs, action, chunk_valid), the log_prob of the "
            "chunk's valid steps only",
        ),
    )

    @classmethod
    def schedule(cls, config: BCConfig) -> Schedule:
        return Schedule(rollout_unit="none", iterations=config.iterations)

    @classmethod
    def check_plan(cls, config: BCConfig, plan: PlanFacts) -> None:
        demonstration_files(config.demos)
        if config.batch_size % plan.trainer_ranks:
            raise UserError(
                f"algo.batch_size={config.batch_size} cannot be shared equally by {plan.trainer_ranks} trainers; "
                f"make it a multiple of {plan.trainer_ranks}"
            )
        if plan.asked_policy_lag:
            raise UserError(
                f"algo.class bc rolls out nothing; the engine asks for a policy lag of {plan.asked_policy_lag}: "
                f"use the sync engine"
            )

    @classmethod
    def check_spaces(cls, config: BCConfig, observation_space: gym.Space[Any], action_space: gym.Space[Any]) -> None:
        check_files(demonstration_files(config.demos), expected_layout(observation_space, action_space))

    @classmethod
    def summary(cls, config: BCConfig, plan: PlanFacts) -> str:
        return (
            f"behaviour cloning on {config.demos}, {config.update_epochs} epoch(s) per iteration in minibatches of "
            f"{config.batch_size} decisions"
        )

    def __init__(self, policy: Policy, config: BCConfig, context: Context):
        super().__init__(policy, config, context)
        self.cfg = config
        # 1. This trainer's share of the demonstrations (every num_trainers-th episode), actions as the policy's.
        layout = expected_layout(context.observation_space, context.action_space)
        share = read_share(demonstration_files(config.demos), layout, context.trainer_index, context.num_trainers)
        self.decisions = share.decisions
        self.decisions["action"] = self.decisions["action"].to(policy.outputs()["action"].dtype)
        self.chunked = CHUNK_VALID in self.decisions.keys()
        if self.chunked and CHUNK_VALID not in inspect.signature(policy.forward).parameters:
            raise UserError(
                f"algo.demos={config.demos} holds action chunks with chunk_valid, and policy {type(policy).__name__}'s "
                f"forward takes no chunk_valid: define forward(self, obs, action, chunk_valid=None) whose log_prob "
                f"sums only the chunk's valid steps (chunk_valid [B, K] bool), as the built-in policies' do"
            )
        counts = torch.zeros(context.num_trainers, dtype=torch.float64)
        counts[context.trainer_index] = len(self.decisions)
        counts = self.context.all_reduce(counts, "bc demonstration counts")
        if bool((counts == 0).any()):  # every trainer sees the same counts, so all refuse alike
            raise UserError(
                f"algo.demos={config.demos}: {share.episodes} episode(s) with {int(counts.sum())} decisions cannot "
                f"give each of the {context.num_trainers} trainers one; give more demonstrations or fewer trainers"
            )
        self.total_decisions, self.episodes, self.cut_chunks = int(counts.sum()), share.episodes, share.cut_chunks
        # A policy with running observation statistics (policy.normalize_obs) takes them from all the demonstrations
        # once, merged over the trainers: what it learns to act on is what RL from its weights then normalizes with.
        policy.update_normalizer(self.decisions["obs"].to(context.device), context)
        self.local_batch = config.batch_size // context.num_trainers
        self.steps_per_epoch = math.ceil(self.total_decisions / config.batch_size)
        # 2. The model, laid out as train.parallel says, and its optimizer.
        self.model = context.data_parallel(policy)
        self.parameters = [param for param in policy.parameters() if param.requires_grad]
        self.optimizer = torch.optim.Adam(self.parameters, lr=config.learning_rate, eps=1e-5, fused=True)
        self.adam_step = FusedAdamStep(self.optimizer)

    def learn(self, segment: TensorDict, iteration: int) -> dict[str, float]:
        cfg = self.cfg
        steps = []
        for epoch in range(cfg.update_epochs):
            order = self._order(iteration * cfg.update_epochs + epoch)
            for step in range(self.steps_per_epoch):
                # Every trainer takes local_batch rows per step, however many it holds (a small share wraps round).
                rows = order[(step * self.local_batch + torch.arange(self.local_batch)) % len(order)]
                steps.append(self._step(self.decisions[rows].to(self.context.device)))
        metrics = {key: float(torch.stack([step[key] for step in steps]).mean()) for key in steps[0]}
        return {
            **metrics,
            "minibatch_steps": float(len(steps)),
            "demo_decisions": float(self.total_decisions),
            "demo_episodes": float(self.episodes),
            "demo_cut_chunks": float(self.cut_chunks),
            "learning_rate": cfg.learning_rate,
        }

    def _order(self, epoch: int) -> Tensor:
        """This trainer's rows in the order of one epoch: a permutation from (train.seed, trainer, epoch) alone, so
        a resumed run takes the same minibatches with no generator state in its checkpoint."""
        seed = np.random.SeedSequence([self.context.seed, self.context.trainer_index, epoch]).generate_state(1)[0]
        return torch.randperm(len(self.decisions), generator=torch.Generator().manual_seed(int(seed)))

    def _step(self, minibatch: TensorDict) -> dict[str, Tensor]:
        """One optimizer step on the negative log-likelihood of the minibatch's demonstrated actions."""
        # With chunks a decision's log_prob is its valid steps' sum, so over the decision count every demonstrated
        # action weighs alike (DDP's mean over trainers of equal minibatches keeps it so).
        steps = {"chunk_valid": minibatch[CHUNK_VALID]} if self.chunked else {}
        log_prob, entropy, value = self.model(minibatch["obs"], minibatch["action"], **steps)
        nll = -log_prob.mean()
        # The value output takes no part, but DDP expects a gradient for every parameter that took part in forward.
        loss = nll + 0.0 * value.sum()
        for param in self.parameters:
            param.grad = None
        loss.backward()
        if self.cfg.max_grad_norm:
            clip_grad_norm(self.parameters, self.cfg.max_grad_norm)
        self.adam_step()
        return {"nll_loss": nll.detach(), "entropy": entropy.detach().mean()}

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
