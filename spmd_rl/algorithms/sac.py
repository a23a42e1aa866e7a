"""Soft Actor-Critic (Haarnoja et al. 2018) with the semantics of CleanRL's sac_continuous_action.

Read top to bottom: the soft TD target, the twin-critic step, the delayed actor and temperature steps, the Polyak
update of the target critics. One `update` call is one critic gradient step on a replay batch.

Data-parallel trainers average every optimizer step's gradients over the trainer group (Context.backward and
reduce_gradients: one all_reduce of one flat buffer per step) instead of wrapping the networks in DDP: an update
runs several modules through several optimizers, and the actor's loss backpropagates through the critics, which
that step must not change. DDP would hook and all_reduce the critics' gradients on every backward through them (and
need find_unused_parameters for the rest); averaging exactly the gradients each optimizer is about to apply keeps
every trainer's actor, critics, targets and temperature bit-identical with the fewest messages. With
train.parallel=fsdp the actor, the critics and the target critics are sharded (Context.shard) and the same calls
reduce-scatter the gradients in backward; each step clears its own gradients first, so the critics' gradients from
an actor step are never applied.
"""

from __future__ import annotations

import math

import torch
from tensordict import TensorDict
from torch import Tensor

from spmd_rl.algorithms.configs import SACConfig
from spmd_rl.algorithms.twin_critic import TwinCriticLearner, as_floats, transitions_of
from spmd_rl.interfaces.algorithm import PolicyMethod
from spmd_rl.interfaces.context import Context
from spmd_rl.modules.sac_td3_networks import SquashedGaussianActor

__all__ = ["SAC", "as_floats", "transitions_of"]  # the last two: their home is twin_critic.py


class SAC(TwinCriticLearner[SACConfig]):
    """Owns the critics, their targets, the temperature, the three optimizers and the replay shard; updates the
    policy (a SquashedGaussianActor, or any policy with `sample(obs)` and `features(obs)`).

    learn(segment) stores the segment's transitions in this trainer's replay shard; after algo.learning_starts env
    steps it takes algo.updates_per_step gradient steps per env step, each an `update(batch)` on a batch sampled
    uniformly over all trainers' shards. update(batch) takes a TensorDict [B] of real transitions: obs, action
    (env units), reward (float32), next_obs (the real next observation, the final one when the episode ended) and
    terminated (bool). Truncation is not termination: a transition cut by a time limit is passed with
    terminated=False and still bootstraps. The batch must be on the actor's device.
    """

    Config = SACConfig
    name = "SAC"
    policy_methods = (
        PolicyMethod("sample", ("obs",), ("action", "log_prob"), "a reparameterized sample, with gradients"),
        PolicyMethod("features", ("obs",), "features", "observations as the critics see them"),
    )

    actor: SquashedGaussianActor

    def __init__(self, actor: SquashedGaussianActor, cfg: SACConfig, context: Context):
        super().__init__(actor, cfg, context)
        self.cfg = cfg
        self.actor = actor
        device = context.device
        self.build_critics(context)
        # alpha = exp(log_alpha) stays positive while Adam moves log_alpha freely.
        initial_log_alpha = math.log(cfg.alpha) if cfg.alpha > 0 else -math.inf
        self.log_alpha = torch.tensor(initial_log_alpha, device=device, requires_grad=cfg.autotune)
        self.target_entropy = -float(self.actor.action_scale.shape[0])  # the action Box's width

        # Every trainer starts from the first trainer's actor, critics, targets and temperature (whole tensors:
        # with train.parallel=fsdp each trainer then keeps its shards of them).
        self.sync_from_first_trainer()
        methods = tuple(method.name if isinstance(method, PolicyMethod) else method for method in self.policy_methods)
        self.actor = context.shard(actor, ("act", *methods))
        self.shard_critics(context)

        # The actor's trainable parameters: a frozen one (requires_grad False) gets no gradient and no Adam state.
        self.actor_params = [param for param in actor.parameters() if param.requires_grad]
        # fused: one kernel over all parameters instead of a dozen small ops per tensor.
        self.actor_optimizer = torch.optim.Adam(self.actor_params, lr=cfg.policy_lr, fused=True)
        self.alpha_optimizer = (
            torch.optim.Adam([self.log_alpha], lr=cfg.policy_lr, fused=True) if cfg.autotune else None
        )

        self.build_replay(context)

    @property
    def alpha(self) -> Tensor:
        """The entropy temperature, a constant for the losses (only the temperature's own loss moves it)."""
        return self.log_alpha.detach().exp()

    # -----------------------------------------------------------------------------------------------------------
    # Losses

    @torch.no_grad()
    def td_target(self, reward: Tensor, next_obs: Tensor, terminated: Tensor) -> Tensor:
        """r + gamma * (min_i Q_target_i(s', a') - alpha * log pi(a'|s')) with a' ~ pi(s'); just r when terminated."""
        next_action, next_log_prob = self.actor.sample(next_obs)
        q1, q2 = self.critic_target(self.actor.features(next_obs), next_action)
        soft_value = torch.min(q1, q2) - self.alpha * next_log_prob
        return reward + torch.where(terminated, 0.0, self.cfg.gamma * soft_value)

    def actor_losses(self, obs: Tensor) -> tuple[Tensor, Tensor | None]:
        """(actor loss, temperature loss or None when alpha is fixed) on fresh reparameterized actions.

        actor:       E[alpha * log pi(a|s) - min_i Q_i(s, a)],   a ~ pi(s)
        temperature: E[-alpha * (log pi(a|s) + target_entropy)],  log pi held constant: CleanRL's loss on the
                     actor step's own log-probs (as SB3) instead of a second sample drawn after the actor's step,
                     so one forward pass serves both and their gradients travel in one all_reduce
        """
        action, log_prob = self.actor.sample(obs)
        q1, q2 = self.critic(self.actor.features(obs), action)
        actor_loss = (self.alpha * log_prob - torch.min(q1, q2)).mean()
        if self.alpha_optimizer is None:
            return actor_loss, None
        alpha_loss = -(self.log_alpha.exp() * (log_prob.detach() + self.target_entropy)).mean()
        return actor_loss, alpha_loss

    # -----------------------------------------------------------------------------------------------------------
    # Update

    def update_tensors(self, batch: TensorDict) -> dict[str, Tensor]:
        """One critic step; every policy_frequency-th call also policy_frequency actor (and temperature) steps;
        every target_network_frequency-th call a Polyak update of the target critics.

        Returns what this call computed, as 0-d tensors (learn() reads only its last update's, so the others cost
        no copy to Python floats and, on a GPU, no wait for the device): qf1_loss, qf2_loss, qf_loss, q1_mean and
        alpha always; actor_loss and alpha_loss (autotune) of the last actor step when there was one."""
        cfg = self.cfg
        self.num_updates += 1
        obs = batch["obs"]

        target = self.td_target(batch["reward"], batch["next_obs"], batch["terminated"])
        if 0 < cfg.micro_batch_size < obs.shape[0]:  # algo.micro_batch_size: the same steps, in parts
            return self.update_in_parts(batch, target)
        losses = self.critic_losses(obs, batch["action"], target)
        self._step([self.critic_optimizer], self.critic_params, losses["qf_loss"], "critic")
        metrics = {name: losses[name] for name in ("qf1_loss", "qf2_loss", "qf_loss", "q1_mean")}

        # TD3-style delay: the actor waits policy_frequency critic steps, then catches up with as many steps.
        if self.num_updates % cfg.policy_frequency == 0:
            for _ in range(cfg.policy_frequency):
                actor_loss, alpha_loss = self.actor_losses(obs)
                if alpha_loss is None:
                    self._step([self.actor_optimizer], self.actor_params, actor_loss, "actor")
                else:
                    assert self.alpha_optimizer is not None  # a temperature loss comes with its optimizer
                    # Disjoint parameters: one backward of the sum gives both gradients, one all_reduce both.
                    self._step(
                        [self.actor_optimizer, self.alpha_optimizer],
                        [*self.actor_params, self.log_alpha],
                        actor_loss + alpha_loss,
                        "actor and temperature",
                    )
                    metrics["alpha_loss"] = alpha_loss
                metrics["actor_loss"] = actor_loss

        if self.num_updates % cfg.target_network_frequency == 0:
            self.update_targets()
        metrics["alpha"] = self.alpha
        return {name: value.detach() for name, value in metrics.items()}

    def update_in_parts(self, batch: TensorDict, target: Tensor) -> dict[str, Tensor]:
        """update_tensors with algo.micro_batch_size: every step's forward and backward run in parts of at most
        that many rows, each part's loss weighted by its share of the batch (the losses are batch means), so the
        summed gradients are the whole batch's; then one average over the trainers and one step, as without parts.

        The TD target (no gradients) is computed on the whole batch first, as without parts. The actor's parts
        draw their reparameterization noise one after another: on the CPU the same numbers as one draw for the
        whole batch when each part holds a multiple of 16 of them, otherwise other draws of the same distribution."""
        obs, action = batch["obs"], batch["action"]
        size = obs.shape[0]
        parts = [slice(start, start + self.cfg.micro_batch_size) for start in range(0, size, self.cfg.micro_batch_size)]

        def critic_part(rows: slice) -> dict[str, Tensor]:
            return self.critic_losses(obs[rows], action[rows], target[rows], size)

        metrics = self._step_in_parts([self.critic_optimizer], self.critic_params, critic_part, parts, "critic")
        if self.num_updates % self.cfg.policy_frequency == 0:
            autotune = self.alpha_optimizer is not None
            optimizers = (
                [self.actor_optimizer, self.alpha_optimizer]
                if self.alpha_optimizer is not None
                else [self.actor_optimizer]
            )
            params = [*self.actor_params, self.log_alpha] if autotune else self.actor_params
            what = "actor and temperature" if autotune else "actor"

            def actor_part(rows: slice) -> dict[str, Tensor]:
                part_obs = obs[rows]
                weight = part_obs.shape[0] / size
                pi_loss, alpha_loss = self.actor_losses(part_obs)
                if alpha_loss is None:
                    return {"actor_loss": pi_loss * weight}
                pi_loss, alpha_loss = pi_loss * weight, alpha_loss * weight
                return {"both": pi_loss + alpha_loss, "actor_loss": pi_loss, "alpha_loss": alpha_loss}

            for _ in range(self.cfg.policy_frequency):
                step = self._step_in_parts(optimizers, params, actor_part, parts, what)
                metrics.update({name: step[name] for name in ("actor_loss", "alpha_loss") if name in step})
        if self.num_updates % self.cfg.target_network_frequency == 0:
            self.update_targets()
        metrics["alpha"] = self.alpha
        return {name: value.detach() for name, value in metrics.items()}

    # -----------------------------------------------------------------------------------------------------------
    # Start-up and checkpoints

    @torch.no_grad()
    def sync_from_first_trainer(self) -> None:
        """Make every trainer's actor (parameters and buffers), critics, targets and temperature the first
        trainer's. Every trainer calls it, once at start-up, before sharding; a no-op for a single trainer."""
        if self.context.group is None:
            return
        tensors = [
            *self.actor.parameters(),
            *self.actor.buffers(),
            *self.critic.parameters(),
            *self.critic_target.parameters(),
            self.log_alpha,
        ]
        self.context.broadcast_tensors(tensors, "SAC initial state")

    def state_dict(self) -> dict:
        """Critics, targets, temperature, optimizers, counters and the replay shard (the actor is saved with the
        policy)."""
        return {
            **self.critic_state(),
            "log_alpha": self.log_alpha.detach().clone(),
            "actor_optimizer": self.actor_optimizer.state_dict(),
            "alpha_optimizer": None if self.alpha_optimizer is None else self.alpha_optimizer.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.load_critic_state(state)
        with torch.no_grad():
            self.log_alpha.copy_(state["log_alpha"])
        self.actor_optimizer.load_state_dict(state["actor_optimizer"])
        if self.alpha_optimizer is not None:
            self.alpha_optimizer.load_state_dict(state["alpha_optimizer"])
