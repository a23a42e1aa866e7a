"""A2C, the synchronous advantage actor-critic (Mnih et al. 2016), as a user's own algorithm: `algo.class: a2c:A2C`.

Per iteration: n-step returns from the rollout, bootstrapped from the critic; then one gradient step on
policy loss + value loss - entropy bonus, with the learning rate decayed linearly over the run. Written against
spmd_rl.api only: `context.data_parallel` averages the gradients over trainers (DDP), so this file holds no
distributed code.
"""

from dataclasses import dataclass
from typing import ClassVar

import torch
from tensordict import TensorDict
from torch import Tensor, nn

from spmd_rl.api import Algorithm, AlgorithmConfig, knob


@dataclass
class A2CConfig(AlgorithmConfig):
    default_policy: ClassVar[str] = "actor_critic"
    learning_rate: float = knob(7e-4, "RMSprop learning rate", min=0.0)
    anneal_lr: bool = knob(True, "decay the learning rate linearly to 0 over the run (as the A3C paper)")
    gamma: float = knob(0.99, "discount factor", min=0.0, max=1.0)
    ent_coef: float = knob(0.0, "entropy bonus coefficient", min=0.0)
    vf_coef: float = knob(0.5, "value loss coefficient", min=0.0)
    max_grad_norm: float = knob(0.5, "gradient norm clipping", min=0.0)


def n_step_returns(
    reward: Tensor, value: Tensor, next_value: Tensor, terminated: Tensor, truncated: Tensor, gamma: float
) -> Tensor:
    """R_t = r_t + gamma * R', where R' is 0 after a termination, V(final obs) after a truncation (the value
    recorded on the step that follows it), R_{t+1} otherwise, and V(next_obs) after the last step. [T, N]."""
    following = torch.cat([value[1:], next_value.unsqueeze(0)])
    returns = torch.empty_like(reward)
    running = next_value
    for t in reversed(range(reward.shape[0])):
        running = torch.where(truncated[t], following[t], running)
        running = reward[t] + gamma * running * (~terminated[t]).float()
        returns[t] = running
    return returns


class A2C(Algorithm):
    Config = A2CConfig
    requires = ("value",)  # the critic's value at every step, for bootstrapping
    policy_methods = ("evaluate", "value")  # evaluate(obs, action) -> (log_prob, entropy, value); value(obs)

    def __init__(self, policy, config: A2CConfig, context):
        super().__init__(policy, config, context)
        self.model = context.data_parallel(policy)  # route the loss through forward() = evaluate()
        self.optimizer = torch.optim.RMSprop(policy.parameters(), lr=config.learning_rate, alpha=0.99, eps=1e-5)

    def learn(self, segment: TensorDict, iteration: int) -> dict[str, float]:
        cfg, device = self.config, self.context.device
        lr = cfg.learning_rate * ((1 - iteration / self.context.num_iterations) if cfg.anneal_lr else 1.0)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        rollout = segment["rollout"].to(device)
        with torch.no_grad():
            next_value = self.policy.value(segment["next_obs"].to(device))
        returns = n_step_returns(
            rollout["reward"], rollout["value"], next_value, rollout["terminated"], rollout["truncated"], cfg.gamma
        )
        batch = TensorDict(
            {"obs": rollout["obs"], "action": rollout["action"], "valid": rollout["valid"], "return_": returns},
            batch_size=rollout.batch_size,
        ).reshape(-1)
        # A step right after an episode end only reset its env: no transition, weight 0 in every mean. Its
        # return is zeroed too, so nothing stored there reaches a gradient (0 * inf would be NaN).
        valid = batch["valid"]
        weight = valid.float() / valid.sum().clamp(min=1)
        returns = torch.where(valid, batch["return_"], 0.0)

        log_prob, entropy, value = self.model(batch["obs"], batch["action"])
        advantage = (returns - value).detach()
        policy_loss = -(advantage * log_prob) @ weight
        value_loss = (returns - value).square() @ weight
        entropy = entropy @ weight
        loss = policy_loss + cfg.vf_coef * value_loss - cfg.ent_coef * entropy
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(self.policy.parameters(), cfg.max_grad_norm)
        self.optimizer.step()
        self.policy.update_normalizer(batch["obs"][valid], self.context)
        return {
            "policy_loss": policy_loss.item(),
            "value_loss": value_loss.item(),
            "entropy": entropy.item(),
            "learning_rate": lr,
        }

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
