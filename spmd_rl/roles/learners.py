"""How a trainer learns from the segments it receives, per algorithm.

PPO learns on-policy from the segment just collected; SAC stores the segment's transitions in its replay shard
and learns from uniform samples over all shards. Both read the same segment layout (roles/messages.py).
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

from spmd_rl.algorithms.ppo import PPO, compute_gae


class PPOLearner:
    def __init__(self, policy, ppo: PPO, group, device: torch.device):
        self.policy = policy
        self.ppo = ppo
        self.group = group
        self.device = device

    def learn(self, segment: TensorDict, iteration: int) -> dict[str, float]:
        rollout = segment["rollout"].to(self.device)
        cfg = self.ppo.cfg
        with torch.no_grad():
            next_value = self.policy.value(segment["next_obs"].to(self.device))
        advantage, return_ = compute_gae(rollout["reward"], rollout["value"], next_value,
                                         rollout["terminated"], rollout["truncated"], cfg.gamma, cfg.gae_lambda)
        batch = TensorDict({
            "obs": rollout["obs"], "action": rollout["action"], "log_prob": rollout["log_prob"],
            "value": rollout["value"], "valid": rollout["valid"], "advantage": advantage, "return_": return_,
        }, batch_size=rollout.batch_size).reshape(-1)
        metrics = self.ppo.update(batch, iteration)
        # The statistics used to collect this rollout stay fixed while learning from it; fold the rollout's
        # observations in afterwards, so the next rollout (and its learning) use the merged statistics.
        self.policy.obs_normalizer.update(batch["obs"][batch["valid"]], group=self.group, timeout=self.ppo.timeout)
        return metrics

    def close(self) -> None:
        pass


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
    return TensorDict({
        "obs": rollout["obs"][valid],
        "action": rollout["action"][valid],
        "reward": rollout["reward"][valid],
        "next_obs": next_obs[valid],
        "terminated": rollout["terminated"][valid],
    }, batch_size=[int(valid.sum())])


class SACLearner:
    def __init__(self, sac, replay, batch_size: int, updates_per_step: float, learning_starts: int,
                 steps_per_iteration: int, device: torch.device):
        self.sac = sac
        self.replay = replay                # ShardedReplay: this trainer's shard, sampled uniformly over all
        self.batch_size = batch_size
        self.updates_per_iteration = updates_per_step * steps_per_iteration
        self.learning_starts = learning_starts
        self.steps_per_iteration = steps_per_iteration
        self.device = device
        self.updates_owed = 0.0             # fractional updates carry over, so the long-run ratio is exact

    def learn(self, segment: TensorDict, iteration: int) -> dict[str, float]:
        transitions = transitions_of(segment)
        self.replay.shard.add(transitions)
        # Observation statistics (actor buffers, broadcast with its weights) follow the data as it arrives.
        self.sac.actor.obs_normalizer.update(transitions["obs"].to(self.device), group=self.sac.group,
                                             timeout=self.sac.timeout)
        if (iteration + 1) * self.steps_per_iteration < self.learning_starts:
            return {}
        self.updates_owed += self.updates_per_iteration
        metrics: dict[str, float] = {}
        while self.updates_owed >= 1.0:
            metrics = self.sac.update(self.replay.sample(self.batch_size).to(self.device))
            self.updates_owed -= 1.0
        return metrics

    def close(self) -> None:
        self.replay.shard.close()
