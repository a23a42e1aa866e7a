"""The inference server (sync engine): every step, gather the observations of all its env ranks, act for all of
them in one batched forward pass, and send each its actions; between rollouts, take the trainer's new weights.

Env ranks are served in a fixed order (post all receives, wait, one forward pass, post all sends), so the
schedule never depends on data.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import gymnasium as gym
import numpy as np
import torch

from spmd_rl.envs import spaces
from spmd_rl.interfaces.policy import EPISODE_START, RECURRENT_STATE, Policy, StepField, initial_state
from spmd_rl.roles.acting import act_for_replies, write_reply
from spmd_rl.runtime.watchdog import watchdog

if TYPE_CHECKING:  # annotations only
    from spmd_rl.comm.weights import WeightSync


class UniformActions:
    """Off-policy warm-up (SAC's random steps): actions uniform over the action space, the policy's other outputs
    zero. Drawn from torch's generator, so a run stays reproducible from its seed."""

    def __init__(self, action_space: gym.Space, outputs: dict):
        self.outputs = outputs
        self.discrete = isinstance(action_space, gym.spaces.Discrete)
        if isinstance(action_space, gym.spaces.Discrete):
            self.n = int(action_space.n)
            self.start = int(action_space.start)
        elif isinstance(action_space, gym.spaces.Box):
            self.low = torch.as_tensor(action_space.low, dtype=torch.float32)
            self.high = torch.as_tensor(action_space.high, dtype=torch.float32)
        else:
            raise ValueError(f"random warm-up steps need a Discrete or Box action space, not {action_space}")

    def __call__(self, batch: int) -> dict[str, torch.Tensor]:
        if self.discrete:
            action = self.start + torch.randint(self.n, (batch,))
        else:
            action = self.low + torch.rand(batch, *self.low.shape) * (self.high - self.low)
        out = {key: torch.zeros(batch, *f.shape, dtype=f.dtype) for key, f in self.outputs.items()}
        out["action"] = action.to(out["action"].dtype)
        return out


class RecurrentStates:
    """A recurrent policy's state for every env an inference server acts for, kept on its device: env rank k's
    envs are rows offsets[k] .. offsets[k] + counts[k]. Before each forward pass the rows of envs whose step starts
    an episode go back to the initial value; after it, the policy's next state replaces them."""

    def __init__(self, fields: dict[str, StepField], counts: list[int], device: torch.device):
        self.fields = fields
        self.counts = counts
        self.offsets = np.cumsum([0, *counts[:-1]]).tolist()
        self.state = initial_state(fields, sum(counts), device)
        self.initial = {name: torch.tensor(f.initial, dtype=f.dtype, device=device) for name, f in fields.items()}

    def entering(self, served: list[int]) -> dict[str, torch.Tensor]:
        """The state the served env ranks' envs enter this step with, before the reset (what a segment records as
        its first step's), {name: [served envs, *shape]}; the served rows in order."""
        if len(served) == len(self.counts):  # every env rank at once (the sync engine): the whole state
            return self.state
        rows = [self.state_rows(k) for k in served]
        return {name: torch.cat([value[r] for r in rows]) for name, value in self.state.items()}

    def reset(self, entering: dict[str, torch.Tensor], starts: torch.Tensor) -> dict[str, torch.Tensor]:
        """The state acted from: the initial value where an episode starts."""
        starts = starts.to(next(iter(entering.values())).device)
        return {
            name: torch.where(starts.view(-1, *([1] * (value.dim() - 1))), self.initial[name], value)
            for name, value in entering.items()
        }

    def store(self, served: list[int], next_state: dict[str, torch.Tensor]) -> None:
        if len(served) == len(self.counts):
            self.state = {name: next_state[name] for name in self.fields}
            return
        offset = 0
        for k in served:
            rows = self.state_rows(k)
            count = self.counts[k]
            for name in self.fields:
                self.state[name][rows] = next_state[name][offset : offset + count]
            offset += count

    def state_rows(self, k: int) -> slice:
        return slice(self.offsets[k], self.offsets[k] + self.counts[k])

    def state_dict(self) -> dict:
        return {name: value.detach().cpu().clone() for name, value in self.state.items()}

    def load_state_dict(self, state: dict) -> None:
        device = next(iter(self.state.values())).device
        self.state = {name: state[name].to(device) for name in self.fields}


class ServerState:
    """What a checkpoint holds of an inference server (the sync one or an engine's own): a recurrent policy's state
    per env (nothing when stateless). The weights come from trainer 0."""

    states: RecurrentStates | None

    def state_dict(self) -> dict:
        return {} if self.states is None else {RECURRENT_STATE: self.states.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if self.states is not None:
            self.states.load_state_dict(state[RECURRENT_STATE])


@dataclass
class InferenceParts:
    """What an inference rank serves with (built by the run), for the sync server or an engine's own server."""

    policy: Policy
    weight_sync: WeightSync  # weights come from trainer 0
    obs_channels: list  # one per client: each served env rank's pipeline stages, stage by stage
    action_channels: list
    uniform_actions: UniformActions | None  # off-policy warm-up actions (None when the plan has none)
    client_names: list[str]  # each client's rank, and its stage where there are several (for errors)
    states: RecurrentStates | None = None  # a recurrent policy's state per env (None: stateless)
    stages: int = 1  # env.pipeline_stages


class InferenceServer(ServerState):
    def __init__(
        self,
        policy,
        obs_channels: list,
        action_channels: list,
        device: torch.device,
        weight_sync=None,
        uniform_actions: UniformActions | None = None,
        states: RecurrentStates | None = None,
        stages: int = 1,
    ):
        """The channels: one per client, every env rank's stage 0 first, then their stage 1 and so on
        (env.pipeline_stages); each step serves the stages in that order, one forward pass per stage."""
        self.policy = policy
        self.obs_channels = obs_channels
        self.action_channels = action_channels
        self.device = device
        self.weight_sync = weight_sync  # None in the colocated layout: the trainer's module is this module
        self.policy_version = 0
        self.explore_uniformly = False  # act with uniform_actions instead of the policy (warm-up steps)
        self.uniform_actions = uniform_actions
        # numpy views of the reply buffers: cheaper per-step writes than torch ops (see EnvRunner)
        self.replies = [spaces.numpy_views(ch.buffer) for ch in action_channels]
        self.states = states  # None for a stateless policy: no per-step work for states
        per_stage = len(action_channels) // stages
        self.stage_clients = [list(range(s * per_stage, (s + 1) * per_stage)) for s in range(stages)]
        self.fields = dict(policy.outputs())  # what act returns, checked on every step
        self.output_keys = list(self.fields)
        self.watched_act = watchdog.watch("policy.act")  # made once: entered every step (one process has no peer)
        # When the last forward pass ended (split layout): the time from there to the next pass's observations is
        # this rank's idle time, which each reply carries. In one process the wait is the envs' own step: none.
        self.pass_end = time.perf_counter() if weight_sync is not None else None

    def serve_step(self) -> None:
        """One env step of every client: per pipeline stage, its env ranks' observations, one forward pass, their
        replies."""
        for served in self.stage_clients:
            self._serve(served)

    def serve_stage(self, stage: int) -> None:
        """One env step of one pipeline stage's clients (in one process, the stage's runner asks for it)."""
        self._serve(self.stage_clients[stage])

    def _serve(self, served: list[int]) -> None:
        pending = [self.obs_channels[index].irecv() for index in served]
        messages = [message.wait() for message in pending]
        idle_s = 0.0 if self.pass_end is None else time.perf_counter() - self.pass_end
        observations = [message["obs"] for message in messages]
        obs = observations[0] if len(observations) == 1 else torch.cat(observations)
        replies = [self.replies[index] for index in served]

        outputs, inference_s = act_for_replies(
            self.policy,
            obs,
            self.device,
            self.fields,
            self.uniform_actions if self.explore_uniformly else None,
            self.states,
            served,
            [message[EPISODE_START] for message in messages] if self.states is not None else (),
            replies,
            self.watched_act,
        )
        sends = []
        offset = 0
        for index, reply in zip(served, replies):
            offset = write_reply(reply, self.output_keys, outputs, offset, self.policy_version, inference_s, idle_s)
            sends.append(self.action_channels[index].isend())
        for send in sends:
            send.wait()
        if self.pass_end is not None:
            self.pass_end = time.perf_counter()

    def receive_weights(self) -> None:
        """Split layout, at the fixed point between rollouts: the trainer's weights and their version."""
        self.policy_version = self.weight_sync.broadcast(self.policy_version)  # receivers get the sender's version
        self.pass_end = time.perf_counter()  # the wait for weights is the weight sync's time, not idle

    def take_weights(self, verify_every: int) -> None:
        """receive_weights, then check them against trainer 0's checksums when weights.verify_every says so."""
        self.receive_weights()
        if verify_every and self.policy_version % verify_every == 0:
            self.weight_sync.verify(self.policy_version)
