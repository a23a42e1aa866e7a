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

import copy
import math

import torch
import torch.nn.functional as F
from tensordict import TensorDict
from torch import Tensor
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from spmd_rl.algorithms.configs import SACConfig
from spmd_rl.envs.spaces import zeros_of
from spmd_rl.interfaces.algorithm import ANY_LAG, Algorithm, PlanFacts, PolicyMethod, Schedule
from spmd_rl.interfaces.context import Context
from spmd_rl.modules.sac_networks import SquashedGaussianActor, TwinQ
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


class SAC(Algorithm):
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
    reshard_refusal = (
        "each trainer's replay shard is its own, and a resharded resume would give every trainer trainer 0's"
    )
    policy_methods = (
        PolicyMethod("sample", ("obs",), ("action", "log_prob"), "a reparameterized sample, with gradients"),
        PolicyMethod("features", ("obs",), "features", "observations as the critics see them"),
    )

    @classmethod
    def schedule(cls, config: SACConfig) -> Schedule:
        # Off-policy: any lag (the async engine's backpressure keeps it to a few versions).
        return Schedule(
            weight_sync_every=config.weight_sync_every, random_steps=config.learning_starts, max_policy_lag=ANY_LAG
        )

    @classmethod
    def check_plan(cls, config: SACConfig, plan: PlanFacts) -> None:
        if config.batch_size % plan.trainer_ranks:
            raise UserError(
                f"algo.batch_size={config.batch_size} must be a multiple of the {plan.trainer_ranks} "
                f"trainer ranks (each samples an equal share of every batch)"
            )

    @classmethod
    def summary(cls, config: SACConfig, plan: PlanFacts) -> str:
        return (
            f"replay batch {config.batch_size} (all trainers), {config.updates_per_step:g} updates per env step "
            f"after {config.learning_starts} random steps"
        )

    def __init__(self, actor: SquashedGaussianActor, cfg: SACConfig, context: Context):
        super().__init__(actor, cfg, context)
        self.cfg = cfg
        self.actor = actor
        obs_space, action_space = context.observation_space, context.action_space
        device = context.device
        self.critic = TwinQ(obs_space, action_space, list(cfg.critic_hidden_sizes), cfg.critic_activation).to(device)
        self.critic_target = copy.deepcopy(self.critic).requires_grad_(False)
        # alpha = exp(log_alpha) stays positive while Adam moves log_alpha freely.
        initial_log_alpha = math.log(cfg.alpha) if cfg.alpha > 0 else -math.inf
        self.log_alpha = torch.tensor(initial_log_alpha, device=device, requires_grad=cfg.autotune)
        self.target_entropy = -float(action_space.shape[0])

        # Every trainer starts from the first trainer's actor, critics, targets and temperature (whole tensors:
        # with train.parallel=fsdp each trainer then keeps its shards of them).
        self.sync_from_first_trainer()
        methods = tuple(getattr(method, "name", method) for method in self.policy_methods)
        self.actor = context.shard(actor, ("act", *methods))
        self.critic = context.shard(self.critic)
        self.critic_target = context.shard(self.critic_target)

        # The actor's trainable parameters: a frozen one (requires_grad False) gets no gradient and no Adam state.
        self.actor_params = [param for param in actor.parameters() if param.requires_grad]
        self.critic_params = list(self.critic.parameters())
        self.target_params = list(self.critic_target.parameters())
        # fused: one kernel over all parameters instead of a dozen small ops per tensor.
        self.actor_optimizer = torch.optim.Adam(self.actor_params, lr=cfg.policy_lr, fused=True)
        self.critic_optimizer = torch.optim.Adam(self.critic_params, lr=cfg.q_lr, fused=True)
        self.alpha_optimizer = (
            torch.optim.Adam([self.log_alpha], lr=cfg.policy_lr, fused=True) if cfg.autotune else None
        )
        self.num_updates = 0  # update() calls so far: schedules the delayed actor and target updates

        example = TensorDict(
            {
                "obs": zeros_of(obs_space, 1),
                "action": zeros_of(action_space, 1).float(),
                "reward": torch.zeros(1),
                "next_obs": zeros_of(obs_space, 1),
                "terminated": torch.zeros(1, dtype=torch.bool),
            },
            batch_size=[1],
        )
        self.replay = context.replay_buffer(example)
        self.updates_per_iteration = cfg.updates_per_step * context.steps_per_iteration
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

    def close(self) -> None:
        self.replay.close()

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
        return as_floats(self.update_tensors(batch))

    def update_tensors(self, batch: TensorDict) -> dict[str, Tensor]:
        """update() with its metrics left as 0-d tensors: learn() reads only its last update's, so the others
        cost no copy to Python floats (and, on a GPU, no wait for the device)."""
        cfg = self.cfg
        self.num_updates += 1
        obs = batch["obs"]

        target = self.td_target(batch["reward"], batch["next_obs"], batch["terminated"])
        if 0 < cfg.micro_batch_size < obs.shape[0]:  # algo.micro_batch_size: the same steps, in parts
            return self.update_in_parts(batch, target)
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
            q1, q2 = self.critic(self.actor.features(obs[rows]), action[rows])
            weight = q1.shape[0] / size
            qf1_loss, qf2_loss = F.mse_loss(q1, target[rows]) * weight, F.mse_loss(q2, target[rows]) * weight
            return {
                "qf_loss": qf1_loss + qf2_loss,
                "qf1_loss": qf1_loss,
                "qf2_loss": qf2_loss,
                "q1_mean": q1.sum() / size,
            }

        metrics = self._step_in_parts([self.critic_optimizer], self.critic_params, critic_part, parts, "critic")
        if self.num_updates % self.cfg.policy_frequency == 0:
            autotune = self.alpha_optimizer is not None
            optimizers = [self.actor_optimizer, self.alpha_optimizer] if autotune else [self.actor_optimizer]
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

    def _step_in_parts(
        self, optimizers: list[torch.optim.Optimizer], params: list[Tensor], losses, parts: list[slice], what: str
    ) -> dict[str, Tensor]:
        """_step on the sum of the parts' gradients: losses(rows) gives each part's weighted losses, the first
        of them the one to differentiate; returns each loss summed over the parts (the whole batch's)."""
        totals = {}
        for index, rows in enumerate(parts):
            part = losses(rows)
            self.context.backward(next(iter(part.values())), params, accumulate=index > 0)
            for name, value in part.items():
                totals[name] = totals[name] + value.detach() if name in totals else value.detach()
        self._apply_gradients(optimizers, params, what)
        return totals

    def _step(self, optimizers: list[torch.optim.Optimizer], params: list[Tensor], loss: Tensor, what: str) -> None:
        """Gradients of loss for these parameters (their own: the critics' are not applied in an actor step),
        averaged over the trainer group, then one step of each optimizer."""
        self.context.backward(loss, params)
        self._apply_gradients(optimizers, params, what)

    def _apply_gradients(self, optimizers: list[torch.optim.Optimizer], params: list[Tensor], what: str) -> None:
        """The parameters' gradients averaged over the trainer group, then one step of each optimizer."""
        self.context.reduce_gradients(params, f"SAC {what} gradients (update {self.num_updates})")
        for optimizer in optimizers:
            optimizer.step()

    @torch.no_grad()
    def update_targets(self) -> None:
        """Polyak averaging: target <- tau * critic + (1 - tau) * target."""
        torch._foreach_lerp_(self.target_params, self.critic_params, self.cfg.tau)

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
        for dtype in sorted({t.dtype for t in tensors}, key=str):  # one broadcast per dtype (the normalizer's f64)
            same_dtype = [t for t in tensors if t.dtype == dtype]
            flat = _flatten_dense_tensors([t.detach() for t in same_dtype])
            self.context.broadcast(flat, f"SAC initial state ({dtype})")
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
            "updates_owed": self.updates_owed,
            "replay": self.replay.state_dict(),  # this trainer's rows (or its file's cursor) and the sampler
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
        self.updates_owed = state["updates_owed"]
        self.replay.load_state_dict(state["replay"])
