"""The inference server (sync engine): every step, gather the observations of all its env ranks, act for all of
them in one batched forward pass, and send each its actions; between rollouts, take the trainer's new weights.

Env ranks are served in a fixed order (post all receives, wait, one forward pass, post all sends), so the
schedule never depends on data.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import gymnasium as gym
import torch


class UniformActions:
    """Off-policy warm-up (SAC's random steps): actions uniform over the action space, the policy's other outputs
    zero. Drawn from torch's generator, so a run stays reproducible from its seed."""

    def __init__(self, action_space: gym.Space, outputs: dict):
        self.outputs = outputs
        self.discrete = isinstance(action_space, gym.spaces.Discrete)
        if self.discrete:
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


@dataclass
class InferenceParts:
    """What an inference rank serves with (built by the run), for the sync server or an engine's own server."""

    policy: torch.nn.Module
    weight_sync: object  # spmd_rl.comm.weights.WeightSync (weights come from trainer 0)
    obs_channels: list
    action_channels: list
    uniform_actions: UniformActions | None  # off-policy warm-up actions (None when the plan has none)


class InferenceServer:
    def __init__(
        self,
        policy,
        obs_channels: list,
        action_channels: list,
        device: torch.device,
        weight_sync=None,
        uniform_actions: UniformActions | None = None,
    ):
        self.policy = policy
        self.obs_channels = obs_channels
        self.action_channels = action_channels
        self.device = device
        self.weight_sync = weight_sync  # None in the colocated layout: the trainer's module is this module
        self.policy_version = 0
        self.explore_uniformly = False  # act with uniform_actions instead of the policy (warm-up steps)
        self.uniform_actions = uniform_actions
        self.output_keys = list(policy.outputs())
        self.no_grad = torch.no_grad()  # one reusable context: this runs once per env step
        # numpy views of the reply buffers: cheaper per-step writes than torch ops (see EnvRunner)
        self.replies = [{key: tensor.numpy() for key, tensor in ch.buffer.items()} for ch in action_channels]
        self.splits = [reply["action"].shape[0] for reply in self.replies]

    def serve_step(self) -> None:
        pending = [ch.irecv() for ch in self.obs_channels]
        observations = [message.wait()["obs"] for message in pending]
        obs = observations[0] if len(observations) == 1 else torch.cat(observations)

        clock = time.perf_counter()
        if self.explore_uniformly:
            out = self.uniform_actions(obs.shape[0])
        else:
            with self.no_grad:  # the API promises act() runs without grad; a user's act need not say so
                out = self.policy.act(obs.to(self.device, non_blocking=True))
        if self.device.type == "cpu":
            outputs = [out[key].numpy() for key in self.output_keys]
        else:
            outputs = [out[key].cpu().numpy() for key in self.output_keys]
        inference_s = time.perf_counter() - clock

        sends = []
        offset = 0
        for channel, reply, count in zip(self.action_channels, self.replies, self.splits):
            for key, value in zip(self.output_keys, outputs):
                reply[key][:] = value[offset : offset + count]
            reply["policy_version"][0] = self.policy_version
            reply["inference_s"][0] = inference_s
            sends.append(channel.isend())
            offset += count
        for send in sends:
            send.wait()

    def receive_weights(self) -> None:
        """Split layout, at the fixed point between rollouts: the trainer's weights and their version."""
        self.policy_version = self.weight_sync.broadcast(self.policy_version)  # receivers get the sender's version

    def take_weights(self, verify_every: int) -> None:
        """receive_weights, then check them against trainer 0's checksums when weights.verify_every says so."""
        self.receive_weights()
        if verify_every and self.policy_version % verify_every == 0:
            self.weight_sync.verify(self.policy_version)
