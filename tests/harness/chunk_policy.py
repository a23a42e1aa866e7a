"""A policy whose declared action is a chunk of 4 actions, [4, *action_shape], while it acts one: on an env without
env.action_chunk, the contract check must stop it before start (exit 2) rather than the env at its first step.

    policy.class=tests.harness.chunk_policy:ChunkDeclaringActorCritic
"""

from __future__ import annotations

import dataclasses

from spmd_rl.modules.actor_critic import ActorCritic

CHUNK = 4


class ChunkDeclaringActorCritic(ActorCritic):
    def outputs(self):
        declared = super().outputs()
        action = declared["action"]
        return {**declared, "action": dataclasses.replace(action, shape=(CHUNK, *action.shape))}
