"""What SAC and TD3 share: off-policy learning of twin Q critics from a replay shard.

The transitions of a segment, the learn loop (store the segment, then algo.updates_per_step gradient steps per env
step after algo.learning_starts, each on a batch sampled over all trainers' shards), the twin critics and their
Polyak-averaged targets, the critics' TD loss, every optimizer step's gradient averaging over the trainers
(Context.backward and reduce_gradients: see sac.py's docstring for why not DDP), and the checkpoint of all of it.
A subclass brings its actor's losses, its TD target and its update (`update_tensors`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import torch
import torch.nn.functional as F
from tensordict import TensorDict
from torch import Tensor

from spmd_rl.algorithms.configs import SACConfig, TD3Config
from spmd_rl.algorithms.optimizer_step import FusedAdamStep
from spmd_rl.algorithms.targets import target_copy
from spmd_rl.envs.spaces import zeros_of
from spmd_rl.interfaces.algorithm import ANY_LAG, Algorithm, PlanFacts, Schedule
from spmd_rl.interfaces.context import Context
from spmd_rl.modules.sac_td3_networks import BoundedActor, TwinQ
from spmd_rl.runtime.errors import UserError


def transitions_of(segment: TensorDict) -> TensorDict:
    """The real transitions (s, a, r, s', terminated) of a segment, as rows.

    In NEXT_STEP autoreset mode the observation after step t is obs[t + 1] (the segment's next_obs after the last
    step), also when step t ended an episode: that is then the episode's final observation. Reset steps (valid
    False) are no transitions and are dropped. Truncation is not termination: a truncated transition keeps its
    bootstrap.
    """
    rollout = segment["rollout"]
    next_obs = torch.cat([rollout["obs"][1:], segment["next_obs"].unsqueeze(0)])
    valid = rollout["valid"]
    return TensorDict(
        {
            "obs": rollout["obs"][valid],
            "action": rollout["action"][valid],
            "reward": rollout["reward"][valid],
            "next_obs": next_obs[valid],
            "terminated": rollout["terminated"][valid],
        },
        batch_size=[int(valid.sum())],
    )


def as_floats(metrics: dict[str, Tensor]) -> dict[str, float]:
    """0-d tensors as Python floats, in one copy."""
    names = list(metrics)
    return dict(zip(names, torch.stack([metrics[name] for name in names]).tolist())) if names else {}


# The config a TwinCriticLearner learns with: SAC's or TD3's (both have the keys the shared parts read).
TwinConfigT = TypeVar("TwinConfigT", SACConfig, TD3Config)


class TwinCriticLearner(Algorithm[TwinConfigT]):
    """The twin critics (`critic`, `critic_target`), their optimizer, the update count, the replay shard and the
    learn loop of an actor-critic that learns off-policy. The subclass's __init__ calls `build_critics` before it
    makes its own modules, `shard_critics` after every trainer has the first trainer's modules
    (Context.broadcast_tensors), and `build_replay`; it implements `update_tensors(batch) -> {metric: 0-d
    tensor}` (one critic gradient step and whatever else it does on that batch)."""

    cfg: TwinConfigT  # these two: set by the subclass's __init__
    actor: BoundedActor
    name = "off-policy"  # names the collectives in error lines
    reshard_refusal = (
        "each trainer's replay shard is its own, and a resharded resume would give every trainer trainer 0's"
    )

    @classmethod
    def schedule(cls, config) -> Schedule:
        # Off-policy: any lag (the async engine's backpressure keeps it to a few versions).
        return Schedule(
            weight_sync_every=config.weight_sync_every, random_steps=config.learning_starts, max_policy_lag=ANY_LAG
        )

    @classmethod
    def check_plan(cls, config, plan: PlanFacts) -> None:
        if config.batch_size % plan.trainer_ranks:
            raise UserError(
                f"algo.batch_size={config.batch_size} must be a multiple of the {plan.trainer_ranks} "
                f"trainer ranks (each samples an equal share of every batch)"
            )

    @classmethod
    def summary(cls, config, plan: PlanFacts) -> str:
        return (
            f"replay batch {config.batch_size} (all trainers), {config.updates_per_step:g} updates per env step "
            f"after {config.learning_starts} random steps"
        )

    def build_critics(self, context: Context) -> None:
        """The twin critics (algo.critic_hidden_sizes, algo.critic_activation) and their frozen targets."""
        cfg = self.cfg
        self.critic = TwinQ(
            context.observation_space, context.action_space, list(cfg.critic_hidden_sizes), cfg.critic_activation
        ).to(context.device)
        self.critic_target = target_copy(self.critic)

    def shard_critics(self, context: Context) -> None:
        """The critics and their targets laid out as train.parallel says (after every trainer has the first
        trainer's), their parameter lists and the critics' optimizer (algo.q_lr); the update count from 0."""
        self.critic = context.shard(self.critic, ("q1_value",))  # TD3's actor loss calls q1_value
        self.critic_target = context.shard(self.critic_target)
        self.critic_params: list[Tensor] = list(self.critic.parameters())
        self.target_params: list[Tensor] = list(self.critic_target.parameters())
        # fused: one kernel over all parameters instead of a dozen small ops per tensor.
        self.critic_optimizer = torch.optim.Adam(self.critic_params, lr=self.cfg.q_lr, fused=True)
        self.num_updates = 0  # update() calls so far: schedules the delayed actor and target updates
        # Each optimizer's step() without its Python wrapper (optimizer_step.py), made on its first step.
        self.adam_steps: dict[torch.optim.Optimizer, FusedAdamStep] = {}

    def build_replay(self, context: Context) -> None:
        """This trainer's replay shard of (obs, action, reward, next_obs, terminated) rows."""
        obs_space = context.observation_space
        example = TensorDict(
            {
                "obs": zeros_of(obs_space, 1),
                "action": zeros_of(context.action_space, 1).float(),
                "reward": torch.zeros(1),
                "next_obs": zeros_of(obs_space, 1),
                "terminated": torch.zeros(1, dtype=torch.bool),
            },
            batch_size=[1],
        )
        self.replay = context.replay_buffer(example)
        self.updates_per_iteration = self.cfg.updates_per_step * context.steps_per_iteration
        self.updates_owed = 0.0  # fractional updates carry over, so the long-run ratio is exact

    def learn(self, segment: TensorDict, iteration: int) -> dict[str, float]:
        transitions = transitions_of(segment)
        self.replay.add(transitions)
        # Observation statistics (actor buffers, broadcast with its weights) follow the data as it arrives.
        self.actor.update_normalizer(transitions["obs"].to(self.context.device), self.context)
        if (iteration + 1) * self.context.steps_per_iteration < self.cfg.learning_starts:
            return {}
        self.updates_owed += self.updates_per_iteration
        metrics: dict[str, Tensor] = {}
        while self.updates_owed >= 1.0:
            metrics = self.update_tensors(self.replay.sample(self.cfg.batch_size).to(self.context.device))
            self.updates_owed -= 1.0
        return as_floats(metrics)

    def update(self, batch: TensorDict) -> dict[str, float]:
        """One update (update_tensors) on a batch of transitions, its metrics as floats."""
        return as_floats(self.update_tensors(batch))

    def update_tensors(self, batch: TensorDict) -> dict[str, Tensor]:
        raise NotImplementedError

    def close(self) -> None:
        self.replay.close()

    def critic_losses(self, obs: Tensor, action: Tensor, target: Tensor, batch_size: int = 0) -> dict[str, Tensor]:
        """The twin critics' MSE to the TD target: qf_loss (their sum, to differentiate), qf1_loss, qf2_loss and
        q1_mean. For a part of a batch of batch_size rows (algo.micro_batch_size) each loss is weighted by the
        part's share and q1_mean is the part's sum over batch_size, so that the parts add up to the batch's."""
        q1, q2 = self.critic(self.actor.features(obs), action)
        if not batch_size:
            qf1_loss, qf2_loss, q1_mean = F.mse_loss(q1, target), F.mse_loss(q2, target), q1.mean()
        else:
            weight = q1.shape[0] / batch_size
            qf1_loss, qf2_loss = F.mse_loss(q1, target) * weight, F.mse_loss(q2, target) * weight
            q1_mean = q1.sum() / batch_size
        return {"qf_loss": qf1_loss + qf2_loss, "qf1_loss": qf1_loss, "qf2_loss": qf2_loss, "q1_mean": q1_mean}

    def _step_in_parts(
        self, optimizers: Sequence[torch.optim.Adam], params: Sequence[Tensor], losses, parts: list[slice], what: str
    ) -> dict[str, Tensor]:
        """_step on the sum of the parts' gradients: losses(rows) gives each part's weighted losses, the first
        of them the one to differentiate; returns each loss summed over the parts (the whole batch's)."""
        totals: dict[str, Tensor] = {}
        for index, rows in enumerate(parts):
            part = losses(rows)
            self.context.backward(next(iter(part.values())), params, accumulate=index > 0)
            for name, value in part.items():
                totals[name] = totals[name] + value.detach() if name in totals else value.detach()
        self._apply_gradients(optimizers, params, what)
        return totals

    def _step(self, optimizers: Sequence[torch.optim.Adam], params: Sequence[Tensor], loss: Tensor, what: str) -> None:
        """Gradients of loss for these parameters (their own: the critics' are not applied in an actor step),
        averaged over the trainer group, then one step of each optimizer."""
        self.context.backward(loss, params)
        self._apply_gradients(optimizers, params, what)

    def _apply_gradients(self, optimizers: Sequence[torch.optim.Adam], params: Sequence[Tensor], what: str) -> None:
        """The parameters' gradients averaged over the trainer group, then one step of each optimizer."""
        self.context.reduce_gradients(params, f"{self.name} {what} gradients (update {self.num_updates})")
        for optimizer in optimizers:
            step = self.adam_steps.get(optimizer)
            if step is None:
                step = self.adam_steps[optimizer] = FusedAdamStep(optimizer)
            step()

    @torch.no_grad()
    def update_targets(self) -> None:
        """Polyak averaging: target <- tau * critic + (1 - tau) * target."""
        torch._foreach_lerp_(self.target_params, self.critic_params, self.cfg.tau)

    def critic_state(self) -> dict:
        """The critics, their targets and optimizer, the counters and the replay shard, for a checkpoint."""
        return {
            "critic": self.critic.state_dict(),
            "critic_target": self.critic_target.state_dict(),
            "critic_optimizer": self.critic_optimizer.state_dict(),
            "num_updates": self.num_updates,
            "updates_owed": self.updates_owed,
            "replay": self.replay.state_dict(),  # this trainer's rows (or its file's cursor) and the sampler
        }

    def load_critic_state(self, state: dict) -> None:
        self.critic.load_state_dict(state["critic"])
        self.critic_target.load_state_dict(state["critic_target"])
        self.critic_optimizer.load_state_dict(state["critic_optimizer"])
        self.num_updates = state["num_updates"]
        self.updates_owed = state["updates_owed"]
        self.replay.load_state_dict(state["replay"])
