"""The fixed layouts of every message between roles, computed from the env's spaces and the policy's declared
outputs alone.

Every rank can build every layout without talking to anyone, which is what lets channels preallocate their
buffers once and check each message against the agreed layout.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

from spmd_rl.envs.spaces import zeros_of
from spmd_rl.envs.vector import EnvSpec
from spmd_rl.interfaces.policy import (
    ACTIVE,
    CHUNK_VALID,
    ENV_FIELDS,
    EPISODE_START,
    RECURRENT_STATE,
    SUCCESS_FIELDS,
    StepField,
)

# A segment's timings of its rollout, one float64 each (summed over an env rank's pipeline stages): seconds in
# env.step; waiting for actions (the env rank idle); in the forward passes that acted for it; the whole rollout (from
# the previous segment sent, or the start, to this one); the inference rank idle before those forward passes.
SEGMENT_TIMINGS = ("env_s", "action_wait_s", "inference_s", "rollout_s", "inference_idle_s")


def _fields(fields: dict[str, StepField], *batch: int) -> dict[str, torch.Tensor]:
    return {key: torch.zeros(*batch, *f.shape, dtype=f.dtype) for key, f in fields.items()}


def stage_channel(name: str, stage: int, stages: int) -> str:
    """The channel of one pipeline stage (env.pipeline_stages): the plain name with one stage, so that a run of one
    stage keeps its channels and their tags."""
    return name if stages == 1 else f"{name} stage {stage}"


def stage_name(stage: int, stages: int) -> str:
    """' in pipeline stage 1' where an env rank has pipeline stages (said in errors beside the rank and the env
    call), nothing without."""
    return "" if stages == 1 else f" in pipeline stage {stage}"


def observation_message(spec: EnvSpec, num_envs: int) -> TensorDict:
    """env runner -> inference server, every step: the observations as the env gives them."""
    return TensorDict({"obs": zeros_of(spec.observation_space, num_envs)}, batch_size=[])


def async_observation_message(spec: EnvSpec, num_envs: int) -> TensorDict:
    """env runner -> inference server in async mode: the observations and the env rank's segment index."""
    message = observation_message(spec, num_envs)
    message["segment"] = torch.zeros(1, dtype=torch.int64)
    return message


def with_episode_starts(message: TensorDict, state: dict[str, StepField] | None, num_envs: int) -> TensorDict:
    """An observation message for a recurrent policy (state not None) also says, per env, whether the step starts
    an episode: where the inference server resets the state. A stateless policy's message is left as it is."""
    if state is not None:
        message[EPISODE_START] = torch.zeros(num_envs, dtype=torch.bool)
    return message


def action_message(
    outputs: dict[str, StepField], num_envs: int, state: dict[str, StepField] | None = None
) -> TensorDict:
    """inference server -> env runner, every step: the policy's outputs (action first). The policy version lets the
    env prove it acted on fresh weights; inference_s (seconds in the forward pass) lets the trainer tell inference
    time from transfer time, idle_s (seconds the inference rank waited for observations before it) what it idled.
    For a recurrent policy, also the state each env entered the step with (before its
    reset at an episode start): the env runner keeps the first step's for the segment."""
    fields = {
        **_fields(outputs, num_envs),
        "policy_version": torch.zeros(1, dtype=torch.int64),
        "inference_s": torch.zeros(1, dtype=torch.float64),
        "idle_s": torch.zeros(1, dtype=torch.float64),  # the inference rank idle before the forward pass
    }
    if state is not None:
        fields[RECURRENT_STATE] = TensorDict(_fields(state, num_envs), batch_size=[])
    return TensorDict(fields, batch_size=[])


def segment_message(
    spec: EnvSpec,
    outputs: dict[str, StepField],
    num_steps: int,
    num_envs: int,
    state: dict[str, StepField] | None = None,
) -> TensorDict:
    """env runner -> trainer, once per rollout: the rollout [T, N] (obs, the policy's outputs, the env fields, and
    the success fields where the env reports a success flag), the observation after it, and the env side's
    timings. For a recurrent policy (state not None), what the learner replays a sequence from: the rollout's
    episode_start flags and the state at the segment's first step. With action chunks (spec.action_chunk K > 1),
    a decision's K rewards [T, N, K] and which of them ran (chunk_valid). In rollouts of whole episodes
    (spec.episodes), which envs' episodes are still running (active)."""
    t, n = num_steps, num_envs
    rollout = TensorDict(
        {
            "obs": zeros_of(spec.observation_space, t, n),
            **_fields(outputs, t, n),
            **_fields(ENV_FIELDS, t, n),
        },
        batch_size=[t, n],
    )
    fields = {
        "rollout": rollout,
        "next_obs": zeros_of(spec.observation_space, n),
        "policy_version": torch.zeros(t, dtype=torch.int64),  # the version each step's actions came from
        **{key: torch.zeros(1, dtype=torch.float64) for key in SEGMENT_TIMINGS},
    }
    if spec.success_key is not None:  # only envs that report a success flag: classic envs keep their layout
        rollout.update(_fields(SUCCESS_FIELDS, t, n))
    if spec.action_chunk > 1:
        rollout["reward"] = torch.zeros(t, n, spec.action_chunk)
        rollout[CHUNK_VALID] = torch.zeros(t, n, spec.action_chunk, dtype=torch.bool)
    if spec.episodes:
        rollout[ACTIVE] = torch.zeros(t, n, dtype=torch.bool)
    if state is not None:
        rollout[EPISODE_START] = torch.zeros(t, n, dtype=torch.bool)
        fields[RECURRENT_STATE] = TensorDict(_fields(state, n), batch_size=[])
    return TensorDict(fields, batch_size=[])
