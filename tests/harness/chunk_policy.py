"""Policies the contract check must stop before start (exit 2), by name:

    policy.class=tests.harness.chunk_policy:ChunkDeclaringActorCritic   # declares a chunk of 4 actions, acts one
    policy.class=tests.harness.chunk_policy:ActFailingActorCritic       # declares what it should; its act raises

On an env without env.action_chunk the first declares [4, *action_shape] while it acts one: the check, not the env
at its first step, must say so. The second's act fails only when called: the check's calls must find it.
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


class ActFailingActorCritic(ActorCritic):
    def act(self, obs, deterministic: bool = False):
        raise RuntimeError("act is broken on purpose")
