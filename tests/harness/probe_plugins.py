"""Plug-ins that report where their code ran, for runs that check the trainer's setting around them:

    algo.class=tests.harness.probe_plugins:FlushProbePPO  policy.class=tests.harness.probe_plugins:FlushProbePolicy

FlushProbePPO is PPO whose metrics add learn_flushed (1.0 when its learn ran with denormal floats flushed to zero)
and act_flushed (the same for the policy's last act in this process; one-process runs only).
"""

from __future__ import annotations

from spmd_rl.algorithms.ppo import PPO
from spmd_rl.modules.actor_critic import ActorCritic
from spmd_rl.roles.trainer import flushing_denormals

# Acting may run on a copy of the policy (weights synced to it), so the record lives in the process, not a module.
act_flushed: list[bool] = []


class FlushProbePolicy(ActorCritic):
    def act(self, obs, deterministic: bool = False):
        act_flushed.append(flushing_denormals())
        return super().act(obs, deterministic)


class FlushProbePPO(PPO):
    def learn(self, segment, iteration: int) -> dict[str, float]:
        flushed = float(flushing_denormals())
        return {**super().learn(segment, iteration), "learn_flushed": flushed, "act_flushed": float(act_flushed[-1])}
