"""Soft Actor-Critic (Haarnoja et al. 2018) with the semantics of CleanRL's sac_continuous_action.

Read top to bottom: the soft TD target, the twin-critic step, the delayed actor and temperature steps, the Polyak
update of the target critics. One `update` call is one critic gradient step on a replay batch.

Data-parallel trainers average every optimizer step's gradients over the trainer group by hand (one all_reduce of
one flat buffer per step) instead of wrapping the networks in DDP: an update runs several modules through several
optimizers, and the actor's loss backpropagates through the critics, which that step must not change. DDP would
hook and all_reduce the critics' gradients on every backward through them (and need find_unused_parameters for the
rest); averaging exactly the gradients each optimizer is about to apply keeps every trainer's actor, critics,
targets and temperature bit-identical with the fewest messages.
"""

from __future__ import annotations

import copy
import datetime
import math

import gymnasium as gym
import torch
import torch.distributed as dist
import torch.nn.functional as F
from tensordict import TensorDict
from torch import Tensor
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from spmd_rl.config import ModelSection, SACSection
from spmd_rl.errors import UserError
from spmd_rl.modules.sac_networks import SquashedGaussianActor, TwinQ
from spmd_rl.runtime import wait

DEFAULT_TIMEOUT = datetime.timedelta(seconds=300)


class SAC:
    """Owns the critics, their targets, the temperature and the three optimizers; updates the given actor.

    update(batch) takes a TensorDict [B] of real transitions: obs, action (env units), reward (float32),
    next_obs (the real next observation, the final one when the episode ended) and terminated (bool). Truncation
    is not termination: a transition cut by a time limit is passed with terminated=False and still bootstraps.
    The batch must be on the actor's device.
    """

    def __init__(self, actor: SquashedGaussianActor, obs_space: gym.Space, action_space: gym.Space,
                 model_cfg: ModelSection, cfg: SACSection, group: dist.ProcessGroup | None = None,
                 timeout: datetime.timedelta = DEFAULT_TIMEOUT):
        if cfg.autotune and cfg.alpha <= 0:
            raise UserError(f"sac.alpha={cfg.alpha} with sac.autotune=true: the temperature is tuned in log space "
                            "from its initial value sac.alpha, which must be > 0")
        self.cfg = cfg
        self.actor = actor
        device = actor.action_scale.device
        self.critic = TwinQ(obs_space, action_space, model_cfg).to(device)
        self.critic_target = copy.deepcopy(self.critic).requires_grad_(False)
        # alpha = exp(log_alpha) stays positive while Adam moves log_alpha freely.
        initial_log_alpha = math.log(cfg.alpha) if cfg.alpha > 0 else -math.inf
        self.log_alpha = torch.tensor(initial_log_alpha, device=device, requires_grad=cfg.autotune)
        self.target_entropy = -float(action_space.shape[0])

        self.actor_params = list(actor.parameters())
        self.critic_params = list(self.critic.parameters())
        self.target_params = list(self.critic_target.parameters())
        # fused: one kernel over all parameters instead of a dozen small ops per tensor.
        self.actor_optimizer = torch.optim.Adam(self.actor_params, lr=cfg.policy_lr, fused=True)
        self.critic_optimizer = torch.optim.Adam(self.critic_params, lr=cfg.q_lr, fused=True)
        self.alpha_optimizer = (torch.optim.Adam([self.log_alpha], lr=cfg.policy_lr, fused=True)
                                if cfg.autotune else None)
        self.num_updates = 0  # update() calls so far: schedules the delayed actor and target updates

        self.timeout = timeout
        self.group = group if group is not None and dist.is_available() and dist.is_initialized() else None
        if self.group is not None and dist.get_rank(self.group) < 0:
            raise RuntimeError(f"rank {dist.get_rank()} is not a member of the SAC trainer group "
                               f"{dist.get_process_group_ranks(self.group)}")

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

    def update(self, batch: TensorDict) -> dict[str, float]:
        """One critic step; every policy_frequency-th call also policy_frequency actor (and temperature) steps;
        every target_network_frequency-th call a Polyak update of the target critics.

        Returns what this call computed: qf1_loss, qf2_loss, qf_loss, q1_mean and alpha always; actor_loss and
        alpha_loss (autotune) of the last actor step when there was one.
        """
        cfg = self.cfg
        self.num_updates += 1
        obs = batch["obs"]

        target = self.td_target(batch["reward"], batch["next_obs"], batch["terminated"])
        q1, q2 = self.critic(self.actor.features(obs), batch["action"])
        qf1_loss = F.mse_loss(q1, target)
        qf2_loss = F.mse_loss(q2, target)
        qf_loss = qf1_loss + qf2_loss
        self._step([self.critic_optimizer], self.critic_params, qf_loss, "critic")
        metrics = {"qf1_loss": qf1_loss, "qf2_loss": qf2_loss, "qf_loss": qf_loss, "q1_mean": q1.mean()}

        # TD3-style delay: the actor waits policy_frequency critic steps, then catches up with as many steps.
        if self.num_updates % cfg.policy_frequency == 0:
            for _ in range(cfg.policy_frequency):
                actor_loss, alpha_loss = self.actor_losses(obs)
                if alpha_loss is None:
                    self._step([self.actor_optimizer], self.actor_params, actor_loss, "actor")
                else:
                    # Disjoint parameters: one backward of the sum gives both gradients, one all_reduce both.
                    self._step([self.actor_optimizer, self.alpha_optimizer], [*self.actor_params, self.log_alpha],
                               actor_loss + alpha_loss, "actor and temperature")
                    metrics["alpha_loss"] = alpha_loss
                metrics["actor_loss"] = actor_loss

        if self.num_updates % cfg.target_network_frequency == 0:
            self.update_targets()
        metrics["alpha"] = self.alpha
        names = list(metrics)
        return dict(zip(names, torch.stack([metrics[name].detach() for name in names]).tolist()))

    def _step(self, optimizers: list[torch.optim.Optimizer], params: list[Tensor], loss: Tensor, what: str
              ) -> None:
        """Gradients of loss for exactly these parameters (none land on the critics during an actor step), averaged
        over the trainer group, then one step of each optimizer."""
        grads = torch.autograd.grad(loss, params)
        grads = self._average_over_group(grads, what)
        for param, grad in zip(params, grads):
            param.grad = grad
        for optimizer in optimizers:
            optimizer.step()

    def _average_over_group(self, grads: tuple[Tensor, ...], what: str) -> tuple[Tensor, ...]:
        if self.group is None:
            return grads
        flat = _flatten_dense_tensors(grads)
        work = dist.all_reduce(flat, group=self.group, async_op=True)
        wait(work, self.timeout, lambda: (
            f"rank {dist.get_rank()}: SAC {what} gradient all_reduce (update {self.num_updates}) with trainer "
            f"ranks {dist.get_process_group_ranks(self.group)}"))
        flat /= dist.get_world_size(self.group)  # gloo has no AVG reduction
        return _unflatten_dense_tensors(flat, grads)

    @torch.no_grad()
    def update_targets(self) -> None:
        """Polyak averaging: target <- tau * critic + (1 - tau) * target."""
        torch._foreach_lerp_(self.target_params, self.critic_params, self.cfg.tau)

    # -----------------------------------------------------------------------------------------------------------
    # Start-up and checkpoints

    @torch.no_grad()
    def sync_from(self, src_rank: int) -> None:
        """Make every trainer's actor (parameters and buffers), critics, targets and temperature those of src_rank
        (a global rank in the group). Every member calls it, once at start-up; a no-op without a group."""
        if self.group is None:
            return
        tensors = [*self.actor.parameters(), *self.actor.buffers(), *self.critic_params, *self.target_params,
                   self.log_alpha]
        for dtype in sorted({t.dtype for t in tensors}, key=str):  # one broadcast per dtype (the normalizer's f64)
            same_dtype = [t for t in tensors if t.dtype == dtype]
            flat = _flatten_dense_tensors([t.detach() for t in same_dtype])
            work = dist.broadcast(flat, src=src_rank, group=self.group, async_op=True)
            wait(work, self.timeout, lambda: (
                f"rank {dist.get_rank()}: SAC initial state broadcast ({dtype}) from rank {src_rank} to trainer "
                f"ranks {dist.get_process_group_ranks(self.group)}"))
            for tensor, value in zip(same_dtype, _unflatten_dense_tensors(flat, same_dtype)):
                tensor.copy_(value)

    def state_dict(self) -> dict:
        """Critics, targets, temperature, optimizers and the update count (the actor is saved with the policy)."""
        return {
            "critic": self.critic.state_dict(),
            "critic_target": self.critic_target.state_dict(),
            "log_alpha": self.log_alpha.detach().clone(),
            "actor_optimizer": self.actor_optimizer.state_dict(),
            "critic_optimizer": self.critic_optimizer.state_dict(),
            "alpha_optimizer": None if self.alpha_optimizer is None else self.alpha_optimizer.state_dict(),
            "num_updates": self.num_updates,
        }

    def load_state_dict(self, state: dict) -> None:
        self.critic.load_state_dict(state["critic"])
        self.critic_target.load_state_dict(state["critic_target"])
        with torch.no_grad():
            self.log_alpha.copy_(state["log_alpha"])
        self.actor_optimizer.load_state_dict(state["actor_optimizer"])
        self.critic_optimizer.load_state_dict(state["critic_optimizer"])
        if self.alpha_optimizer is not None:
            self.alpha_optimizer.load_state_dict(state["alpha_optimizer"])
        self.num_updates = state["num_updates"]
