"""The env worker's story: step my envs with actions from my inference server, record the rollout, and hand each
finished rollout segment to my trainer.

One step is two halves (send observations / receive actions and step) so the colocated engine can run the
inference server in between, in the same process, through local channels.
"""

from __future__ import annotations

import time

import torch


class EnvWorker:
    def __init__(self, envs, first_obs, to_inference, from_inference, to_trainer, num_steps: int):
        self.envs = envs
        self.num_steps = num_steps
        self.to_inference = to_inference
        self.from_inference = from_inference
        self.to_trainer = to_trainer
        # Both outgoing buffers are written in place: the channel sends them without another copy.
        self.obs_out = to_inference.buffer["obs"]
        self.segment = to_trainer.buffer
        self.rollout = self.segment["rollout"]
        self.obs = torch.as_tensor(first_obs, dtype=torch.float32)
        # After a step that ends an episode, the next step only resets that env: its transition is not real.
        self.next_step_valid = torch.ones(envs.num_envs, dtype=torch.bool)
        self._reset_timers()

    def _reset_timers(self):
        self.env_s = self.action_wait_s = self.inference_s = 0.0

    def send_observations(self, t: int) -> None:
        self.rollout["obs"][t] = self.obs
        self.rollout["valid"][t] = self.next_step_valid
        self.obs_out.copy_(self.obs)
        self._action_clock = time.perf_counter()
        self.to_inference.send()

    def receive_actions_and_step(self, t: int) -> None:
        reply = self.from_inference.recv()
        self.action_wait_s += time.perf_counter() - self._action_clock
        self.inference_s += float(reply["inference_s"])
        action = reply["action"]
        self.rollout["action"][t] = action
        self.rollout["log_prob"][t] = reply["log_prob"]
        self.rollout["value"][t] = reply["value"]
        self.segment["policy_version"][t] = reply["policy_version"]

        clock = time.perf_counter()
        obs, reward, terminated, truncated, info = self.envs.step(action.numpy())
        self.env_s += time.perf_counter() - clock

        self.rollout["reward"][t] = torch.as_tensor(reward, dtype=torch.float32)
        self.rollout["terminated"][t] = torch.as_tensor(terminated)
        self.rollout["truncated"][t] = torch.as_tensor(truncated)
        self._record_episodes(t, info)
        self.obs = torch.as_tensor(obs, dtype=torch.float32)
        self.next_step_valid = ~torch.as_tensor(terminated | truncated)

    def _record_episodes(self, t: int, info: dict) -> None:
        episode = info.get("episode")
        done = self.rollout["episode_done"][t]
        if episode is None:
            done.zero_()
            return
        finished = torch.as_tensor(info["_episode"])
        done.copy_(finished)
        self.rollout["episode_return"][t] = torch.as_tensor(episode["r"], dtype=torch.float32) * finished
        self.rollout["episode_length"][t] = torch.as_tensor(episode["l"], dtype=torch.int64) * finished

    def send_segment(self) -> None:
        self.segment["next_obs"].copy_(self.obs)
        self.segment["env_s"].fill_(self.env_s)
        self.segment["action_wait_s"].fill_(self.action_wait_s)
        self.segment["inference_s"].fill_(self.inference_s)
        self.to_trainer.send()
        self._reset_timers()

    def close(self) -> None:
        self.envs.close()


def run_env_rank(worker: EnvWorker, num_iterations: int) -> None:
    """A split-layout env rank: its schedule of sends and receives follows from the config alone."""
    for _ in range(num_iterations):
        for t in range(worker.num_steps):
            worker.send_observations(t)
            worker.receive_actions_and_step(t)
        worker.send_segment()
    worker.close()
