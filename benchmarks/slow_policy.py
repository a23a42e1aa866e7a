"""A stand-in for an expensive policy: the built-in actor-critic whose forward pass for acting sleeps a set time per
env in the batch (as a large model's forward grows with its batch). Used as
policy.class=benchmarks.slow_policy:SlowActorCritic with policy.act_sleep_s_per_env (benchmarks/pipeline.py)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from spmd_rl.config.sections import knob
from spmd_rl.modules.actor_critic import ActorCritic
from spmd_rl.modules.configs import ActorCriticConfig


@dataclass
class SlowActorCriticConfig(ActorCriticConfig):
    act_sleep_s_per_env: float = knob(0.001, "seconds act() sleeps per env of its batch", min=0.0)


class SlowActorCritic(ActorCritic):
    Config = SlowActorCriticConfig

    def __init__(self, observation_space, action_space, config: SlowActorCriticConfig):
        super().__init__(observation_space, action_space, config)
        self.act_sleep_s_per_env = config.act_sleep_s_per_env

    def act(self, obs, deterministic: bool = False):
        time.sleep(self.act_sleep_s_per_env * obs.shape[0])
        return super().act(obs, deterministic)
