"""An env runner on channels within one process (the colocated layout joins the roles so; tests and tools that play
every role themselves too), and the other ends of its channels."""

from __future__ import annotations

from typing import NamedTuple

from spmd_rl.comm.local_channel import LocalRecvChannel, LocalSendChannel, local_channel
from spmd_rl.envs.vector import EnvSpec
from spmd_rl.interfaces.policy import StepField
from spmd_rl.roles.env_runner import EnvRunner
from spmd_rl.roles.messages import action_message, observation_message, segment_message, with_episode_starts


class LocalEnvRunner(NamedTuple):
    """An env runner whose channels stay in this process, and their other ends: the observations the inference
    server reads, the actions it answers through, the segments the trainer receives."""

    runner: EnvRunner
    observations: LocalRecvChannel
    actions: LocalSendChannel
    segments: LocalRecvChannel


def local_env_runner(
    envs,
    first_obs,
    spec: EnvSpec,
    outputs: dict[str, StepField],
    num_steps: int,
    state: dict[str, StepField] | None = None,
    segments: tuple[LocalSendChannel, LocalRecvChannel] | None = None,
    **options,
) -> LocalEnvRunner:
    """An EnvRunner of envs.num_envs envs (options: its keyword arguments) on local channels, as the colocated layout
    joins the roles in one process (and tests and tools that play every role themselves). `segments`: the segment
    channel of several pipeline stages (each runner then given its `columns`); None: a channel of its own."""
    n = envs.num_envs
    obs_out, obs_in = local_channel("observations", with_episode_starts(observation_message(spec, n), state, n))
    actions_out, actions_in = local_channel("actions", action_message(outputs, n, state))
    if segments is None:
        segments = local_channel("segments", segment_message(spec, outputs, num_steps, n, state))
    segments_out, segments_in = segments
    runner = EnvRunner(envs, first_obs, obs_out, actions_in, segments_out, num_steps, list(outputs), **options)
    return LocalEnvRunner(runner, obs_in, actions_out, segments_in)
