"""DQN (Mnih et al. 2015) with Double DQN targets (van Hasselt et al. 2016), n-step returns, a Huber loss and a
target network updated by hard copies or Polyak averaging; SB3's DQN schedule (target updates and epsilon counted
in env steps, gradient steps after each segment).

Read top to bottom: the n-step transitions of a segment, the epsilon schedule, the TD target, the gradient step,
the target update. One `update` call is one gradient step on a replay batch. Data-parallel trainers average each
step's gradients as SAC does (Context.backward, then reduce_gradients: one all_reduce of one flat buffer) and keep
their networks bit-identical; with train.parallel=fsdp the online and the target network are sharded
(Context.shard) and the same calls reduce-scatter the gradients in backward. The replay buffer is sharded over the
trainers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from tensordict import TensorDict
from torch import Tensor

from spmd_rl.algorithms.configs import DQNConfig
from spmd_rl.algorithms.optimizer_step import FusedAdamStep, clip_grad_norm
from spmd_rl.algorithms.targets import local_view, target_copy
from spmd_rl.algorithms.twin_critic import as_floats
from spmd_rl.envs.spaces import zeros_of
from spmd_rl.interfaces.algorithm import ANY_LAG, Algorithm, PlanFacts, PolicyMethod, Schedule
from spmd_rl.interfaces.context import Context
from spmd_rl.modules.masks import action_mask_of, masked
from spmd_rl.runtime.errors import UserError


def n_step_transitions(segment: TensorDict, gamma: float, n: int) -> TensorDict:
    """The real transitions of a segment as rows: obs, action, reward (the n-step return
    r_t + gamma r_{t+1} + ... + gamma^(m-1) r_{t+m-1}), next_obs (the observation after those m steps) and discount
    (gamma^m, 0 when the episode terminated within them), m = n or fewer where the episode ends (termination or
    truncation) or the segment does first.

    NEXT_STEP autoreset: the observation after step t is obs[t + 1] (the segment's next_obs after its last step),
    the episode's final one when step t ended it; reset steps (valid False) are no transitions. Truncation is not
    termination: a truncated episode bootstraps from its final observation."""
    rollout = segment["rollout"]
    after = torch.cat([rollout["obs"][1:], segment["next_obs"].unsqueeze(0)])  # the observation after step t
    reward, terminated, truncated = rollout["reward"].float(), rollout["terminated"], rollout["truncated"]
    steps = reward.shape[0]
    if n == 1:
        n_return, last, discount = reward, None, torch.where(terminated, 0.0, gamma)
    else:
        t = torch.arange(steps).unsqueeze(-1).expand_as(reward)  # [T, E]: each row's first step
        n_return = torch.zeros_like(reward)
        discount = torch.ones_like(reward)
        last = t.clone()  # the step whose following observation is the bootstrap
        ends_in_termination = torch.zeros_like(terminated)
        going = torch.ones_like(terminated)  # rows whose return still takes steps
        for k in range(n):
            index = (t + k).clamp(max=steps - 1)  # step t + k of every row (clamped rows are not going)
            reward_k, terminated_k, truncated_k = (x.gather(0, index) for x in (reward, terminated, truncated))
            going = going & (t + k < steps)
            n_return = n_return + torch.where(going, gamma**k * reward_k, 0.0)
            last = torch.where(going, index, last)
            discount = torch.where(going, gamma ** (k + 1), discount)
            ends_in_termination = ends_in_termination | (going & terminated_k)
            going = going & ~(terminated_k | truncated_k)
        discount = torch.where(ends_in_termination, 0.0, discount)
    valid = rollout["valid"]
    if last is None:
        next_obs = after[valid]
    else:
        envs = torch.arange(reward.shape[1]).expand_as(reward)
        next_obs = after[last[valid], envs[valid]]
    return TensorDict(
        {
            "obs": rollout["obs"][valid],
            "action": rollout["action"][valid],
            "reward": n_return[valid],
            "next_obs": next_obs,
            "discount": discount[valid].float(),
        },
        batch_size=[int(valid.sum())],
    )


class DQN(Algorithm[DQNConfig]):
    """Owns the target network, the optimizer and the replay shard; updates the policy (a QNetwork, or any policy
    with `q_values(obs)` and an `epsilon` buffer).

    learn(segment) updates the target network where the segment's env steps crossed a multiple of
    algo.target_update_interval, stores the segment's n-step transitions, takes algo.updates_per_step gradient
    steps per env step after algo.learning_starts, then sets the policy's epsilon for the next segment.
    update(batch) takes a TensorDict [B]: obs, action, reward (n-step return), next_obs and discount (float32,
    gamma^m or 0), on the policy's device.
    """

    Config = DQNConfig
    policy_methods = (PolicyMethod("q_values", ("obs",), "q_values", "Q(s, a) of every action, with gradients"),)

    @classmethod
    def schedule(cls, config: DQNConfig) -> Schedule:
        return Schedule(
            weight_sync_every=config.weight_sync_every, random_steps=config.learning_starts, max_policy_lag=ANY_LAG
        )

    @classmethod
    def check_plan(cls, config: DQNConfig, plan: PlanFacts) -> None:
        if config.batch_size % plan.trainer_ranks:
            raise UserError(
                f"algo.batch_size={config.batch_size} must be a multiple of the {plan.trainer_ranks} "
                f"trainer ranks (each samples an equal share of every batch)"
            )

    @classmethod
    def summary(cls, config: DQNConfig, plan: PlanFacts) -> str:
        return (
            f"{'Double ' if config.double else ''}DQN, replay batch {config.batch_size} (all trainers), "
            f"{config.updates_per_step:g} updates per env step after {config.learning_starts} random steps, "
            f"{config.n_step}-step returns"
        )

    def __init__(self, policy, cfg: DQNConfig, context: Context):
        super().__init__(policy, cfg, context)
        self.cfg = cfg
        target = target_copy(policy)
        # Every trainer starts from the first trainer's networks (whole tensors: with train.parallel=fsdp each
        # trainer then keeps its shards of them).
        context.broadcast_tensors(
            [*policy.parameters(), *policy.buffers(), *target.parameters(), *target.buffers()], "DQN initial state"
        )
        methods = tuple(method.name if isinstance(method, PolicyMethod) else method for method in self.policy_methods)
        self.q_network = context.shard(policy, ("act", *methods))
        self.target = context.shard(target, methods)
        # The online network's trainable parameters: a frozen one (requires_grad False) gets no Adam state.
        self.params = [param for param in self.q_network.parameters() if param.requires_grad]
        # The tensors a target update reads and writes; with fsdp each trainer's own shards of the parameters
        # (the two networks are sharded alike), which foreach ops take where DTensors are refused.
        self.online_params = [local_view(param) for param in self.q_network.parameters()]
        self.target_params = [local_view(param) for param in self.target.parameters()]
        self.online_buffers, self.target_buffers = list(self.q_network.buffers()), list(self.target.buffers())
        self.optimizer = torch.optim.Adam(self.params, lr=cfg.learning_rate, fused=True)
        self.adam_step = FusedAdamStep(self.optimizer)  # optimizer.step() without its wrapper, once per update
        self.num_updates = 0
        self.total_steps = context.num_iterations * context.steps_per_iteration
        with torch.no_grad():
            self.q_network.epsilon.fill_(self.epsilon_at(0))
        obs_space = context.observation_space
        example = TensorDict(
            {
                "obs": zeros_of(obs_space, 1),
                "action": torch.zeros(1, dtype=torch.int64),
                "reward": torch.zeros(1),
                "next_obs": zeros_of(obs_space, 1),
                "discount": torch.zeros(1),
            },
            batch_size=[1],
        )
        self.replay = context.replay_buffer(example)
        self.updates_per_iteration = cfg.updates_per_step * context.steps_per_iteration
        self.updates_owed = 0.0  # fractional updates carry over, so the long-run ratio is exact

    def epsilon_at(self, env_steps: int) -> float:
        """Linear from exploration_initial_eps to exploration_final_eps over exploration_fraction of the run."""
        cfg = self.cfg
        span = cfg.exploration_fraction * self.total_steps
        progress = 1.0 if span <= 0 else min(1.0, env_steps / span)
        return cfg.exploration_initial_eps + progress * (cfg.exploration_final_eps - cfg.exploration_initial_eps)

    def learn(self, segment: TensorDict, iteration: int) -> dict[str, float]:
        steps_per_iteration = self.context.steps_per_iteration
        before, after = iteration * steps_per_iteration, (iteration + 1) * steps_per_iteration
        # SB3 updates the target during collection, every target_update_interval env steps, from the network the
        # last gradient steps left: the same as these updates before this segment's gradient steps.
        interval = self.cfg.target_update_interval
        target_updates = after // interval - before // interval
        for _ in range(min(target_updates, 1) if self.cfg.tau == 1.0 else target_updates):  # copies: one is all
            self.update_target()
        transitions = n_step_transitions(segment, self.cfg.gamma, self.cfg.n_step)
        self.replay.add(transitions)
        self.q_network.update_normalizer(transitions["obs"].to(self.context.device), self.context)
        metrics: dict[str, Tensor] = {}
        if after >= self.cfg.learning_starts:
            self.updates_owed += self.updates_per_iteration
            while self.updates_owed >= 1.0:
                metrics = self.update_tensors(self.replay.sample(self.cfg.batch_size).to(self.context.device))
                self.updates_owed -= 1.0
        epsilon = self.epsilon_at(after)
        with torch.no_grad():
            self.q_network.epsilon.fill_(epsilon)  # for the next segment: the weight sync carries it
        return {**as_floats(metrics), "epsilon": epsilon}

    def close(self) -> None:
        self.replay.close()

    # -----------------------------------------------------------------------------------------------------------
    # Loss and update

    @torch.no_grad()
    def td_target(self, reward: Tensor, next_obs, discount: Tensor) -> Tensor:
        """R + discount * Q_target(s', a*), a* = argmax_a Q_online(s', a) (Double DQN) or argmax_a Q_target(s', a);
        the argmax over the allowed actions where next_obs carries an action mask."""
        mask = action_mask_of(next_obs)
        target_q = self.target.q_values(next_obs)
        chooser = self.q_network.q_values(next_obs) if self.cfg.double else target_q
        best = masked(chooser, mask).argmax(-1, keepdim=True)
        next_value = target_q.gather(-1, best).squeeze(-1)
        return reward + torch.where(discount > 0, discount * next_value, 0.0)

    def update(self, batch: TensorDict) -> dict[str, float]:
        """One gradient step of the Huber TD loss; returns loss and q_mean."""
        return as_floats(self.update_tensors(batch))

    def update_tensors(self, batch: TensorDict) -> dict[str, Tensor]:
        self.num_updates += 1
        target = self.td_target(batch["reward"], batch["next_obs"], batch["discount"])
        q = self.q_network.q_values(batch["obs"]).gather(-1, batch["action"].long().unsqueeze(-1)).squeeze(-1)
        loss = F.smooth_l1_loss(q, target)
        self.context.backward(loss, self.params)
        self.context.reduce_gradients(self.params, f"DQN gradients (update {self.num_updates})")
        if self.cfg.max_grad_norm > 0:
            clip_grad_norm(self.params, self.cfg.max_grad_norm)
        self.adam_step()
        return {"loss": loss.detach(), "q_mean": q.detach().mean()}

    @torch.no_grad()
    def update_target(self) -> None:
        """target <- online (algo.tau = 1) or tau * online + (1 - tau) * target; buffers (observation statistics)
        are copied."""
        if self.cfg.tau == 1.0:
            torch._foreach_copy_(self.target_params, self.online_params)
        else:
            torch._foreach_lerp_(self.target_params, self.online_params, self.cfg.tau)
        torch._foreach_copy_(self.target_buffers, self.online_buffers)

    # -----------------------------------------------------------------------------------------------------------
    # Checkpoints

    def state_dict(self) -> dict:
        """Target network, optimizer, counters and the replay shard (the online network is saved as the policy)."""
        return {
            "target": self.target.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "num_updates": self.num_updates,
            "updates_owed": self.updates_owed,
            "replay": self.replay.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.target.load_state_dict(state["target"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.num_updates = state["num_updates"]
        self.updates_owed = state["updates_owed"]
        self.replay.load_state_dict(state["replay"])
