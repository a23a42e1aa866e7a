"""TD3 (Fujimoto et al. 2018) with the semantics of Stable-Baselines3's TD3: twin critics, target policy smoothing,
delayed actor and target updates.

Read top to bottom: the smoothed TD target, the twin-critic step, every policy_delay-th step the actor step and the
Polyak updates of the target actor and the target critics. One `update` call is one critic gradient step on a
replay batch. What it shares with SAC (the replay shard, the learn loop, the twin critics and their loss, the
gradient averaging over the trainers, the critics' Polyak update and checkpoint) is twin_critic.py's; the actor
explores by the noise its own `act` adds (modules/deterministic_actor.py), so inference ranks serve it as it is.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict
from torch import Tensor

from spmd_rl.algorithms.configs import TD3Config
from spmd_rl.algorithms.targets import local_view, target_copy
from spmd_rl.algorithms.twin_critic import TwinCriticLearner
from spmd_rl.interfaces.algorithm import PolicyMethod
from spmd_rl.interfaces.context import Context
from spmd_rl.modules.deterministic_actor import DeterministicActor


class TD3(TwinCriticLearner[TD3Config]):
    """Owns the critics, their targets, the target actor, the two optimizers and the replay shard; updates the
    policy (a DeterministicActor, or any policy whose forward(obs) is its action with gradients, with
    `features(obs)` and `action_scale` and `action_bias` buffers).

    update(batch) takes a TensorDict [B] of real transitions as SAC's does: obs, action (env units), reward,
    next_obs and terminated (truncated transitions bootstrap), on the actor's device.
    """

    Config = TD3Config
    name = "TD3"
    policy_methods = (
        PolicyMethod("forward", ("obs",), "action", "the deterministic action in env units, with gradients"),
        PolicyMethod("features", ("obs",), "features", "observations as the critics see them"),
    )

    actor: DeterministicActor

    def __init__(self, actor: DeterministicActor, cfg: TD3Config, context: Context):
        super().__init__(actor, cfg, context)
        self.cfg = cfg
        self.build_critics(context)
        actor_target = target_copy(actor)
        # Every trainer starts from the first trainer's actor, critics and targets (whole tensors: with
        # train.parallel=fsdp each trainer then keeps its shards of them).
        context.broadcast_tensors(
            [
                *actor.parameters(),
                *actor.buffers(),
                *self.critic.parameters(),
                *self.critic_target.parameters(),
                *actor_target.parameters(),
                *actor_target.buffers(),
            ],
            "TD3 initial state",
        )
        methods = tuple(method.name for method in self.policy_methods)
        self.actor = context.shard(actor, ("act", *methods))
        self.actor_target = context.shard(actor_target, methods)
        self.shard_critics(context)
        # The actor's trainable parameters: a frozen one (requires_grad False) gets no gradient and no Adam state.
        self.actor_params = [param for param in self.actor.parameters() if param.requires_grad]
        self.actor_optimizer = torch.optim.Adam(self.actor_params, lr=cfg.policy_lr, fused=True)
        # What the target actor's Polyak update reads and writes (with fsdp: this trainer's shards).
        self.online_actor_params = [local_view(param) for param in self.actor.parameters()]
        self.target_actor_params = [local_view(param) for param in self.actor_target.parameters()]
        self.online_actor_buffers, self.target_actor_buffers = list(actor.buffers()), list(actor_target.buffers())
        self.build_replay(context)

    # -----------------------------------------------------------------------------------------------------------
    # Losses

    @torch.no_grad()
    def td_target(self, reward: Tensor, next_obs: Tensor, terminated: Tensor) -> Tensor:
        """r + gamma * min_i Q_target_i(s', a'), a' = mu_target(s') + clip(eps, -c, c) clipped to the bounds,
        eps ~ N(0, target_policy_noise) (target policy smoothing; eps and c in units of the action's half-range,
        as SB3 adds them to actions scaled to [-1, 1]); just r when terminated."""
        cfg = self.cfg
        scale, bias = self.actor.action_scale, self.actor.action_bias
        next_action = self.actor_target(next_obs)
        noise = (torch.randn_like(next_action) * cfg.target_policy_noise).clamp(
            -cfg.target_noise_clip, cfg.target_noise_clip
        )
        next_action = torch.max(torch.min(next_action + noise * scale, bias + scale), bias - scale)
        q1, q2 = self.critic_target(self.actor.features(next_obs), next_action)
        return reward + torch.where(terminated, 0.0, cfg.gamma * torch.min(q1, q2))

    def actor_loss(self, obs: Tensor) -> Tensor:
        """-E[Q_1(s, mu(s))]: the actor climbs the first critic (the second is not computed)."""
        return -self.critic.q1_value(self.actor.features(obs), self.actor(obs)).mean()

    # -----------------------------------------------------------------------------------------------------------
    # Update

    def update_tensors(self, batch: TensorDict) -> dict[str, Tensor]:
        """One critic step; every policy_delay-th call also one actor step, then the Polyak updates of the target
        critics and the target actor. Returns qf1_loss, qf2_loss, qf_loss and q1_mean, and actor_loss when the
        actor stepped, as 0-d tensors."""
        cfg = self.cfg
        self.num_updates += 1
        obs = batch["obs"]
        target = self.td_target(batch["reward"], batch["next_obs"], batch["terminated"])
        metrics = self.critic_losses(obs, batch["action"], target)
        self._step([self.critic_optimizer], self.critic_params, metrics["qf_loss"], "critic")
        if self.num_updates % cfg.policy_delay == 0:
            actor_loss = self.actor_loss(obs)
            self._step([self.actor_optimizer], self.actor_params, actor_loss, "actor")
            self.update_targets()
            self.update_actor_target()
            metrics["actor_loss"] = actor_loss
        return {name: value.detach() for name, value in metrics.items()}

    @torch.no_grad()
    def update_actor_target(self) -> None:
        """target actor <- tau * actor + (1 - tau) * target actor; its buffers (observation statistics) copied."""
        torch._foreach_lerp_(self.target_actor_params, self.online_actor_params, self.cfg.tau)
        torch._foreach_copy_(self.target_actor_buffers, self.online_actor_buffers)

    # -----------------------------------------------------------------------------------------------------------
    # Checkpoints

    def state_dict(self) -> dict:
        """Critics, targets (the target actor too), optimizers, counters and the replay shard (the actor is saved
        with the policy)."""
        return {
            **self.critic_state(),
            "actor_target": self.actor_target.state_dict(),
            "actor_optimizer": self.actor_optimizer.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.load_critic_state(state)
        self.actor_target.load_state_dict(state["actor_target"])
        self.actor_optimizer.load_state_dict(state["actor_optimizer"])
