"""The env worker's story: step my envs with actions from my inference server, record the rollout, and hand each
finished rollout segment to my trainer.

One step is two halves (send observations / receive actions and step) so the colocated engine can run the
inference server in between, in the same process, through local channels.
"""

from __future__ import annotations

import time

import numpy as np


class EnvWorker:
    def __init__(self, envs, first_obs, to_inference, from_inference, to_trainer, num_steps: int):
        self.envs = envs
        self.num_steps = num_steps
        self.to_inference = to_inference
        self.from_inference = from_inference
        self.to_trainer = to_trainer
        # Both outgoing buffers are written in place, so the channels send them without another copy. The writes
        # go through numpy views of the (CPU) buffers: a numpy assignment costs a fraction of a torch op's
        # dispatch, and this loop runs once per env step.
        self.obs_out = to_inference.buffer["obs"].numpy()
        self.segment = to_trainer.buffer
        self.rollout = {key: tensor.numpy() for key, tensor in self.segment["rollout"].items()}
        self.versions = self.segment["policy_version"].numpy()
        self.obs = np.asarray(first_obs, dtype=np.float32)
        # After a step that ends an episode, the next step only resets that env: its transition is not real.
        self.next_step_valid = np.ones(envs.num_envs, dtype=bool)
        self._reset_timers()

    def _reset_timers(self):
        self.env_s = self.action_wait_s = self.inference_s = 0.0

    def send_observations(self, t: int) -> None:
        self.rollout["obs"][t] = self.obs
        self.rollout["valid"][t] = self.next_step_valid
        self.obs_out[:] = self.obs
        self._action_clock = time.perf_counter()
        self.to_inference.send()

    def receive_actions_and_step(self, t: int) -> None:
        reply = self.from_inference.recv()
        self.action_wait_s += time.perf_counter() - self._action_clock
        self.inference_s += reply["inference_s"].item()
        action = reply["action"].numpy()
        self.rollout["action"][t] = action
        self.rollout["log_prob"][t] = reply["log_prob"].numpy()
        self.rollout["value"][t] = reply["value"].numpy()
        self.versions[t] = reply["policy_version"].item()

        clock = time.perf_counter()
        obs, reward, terminated, truncated, info = self.envs.step(action)
        self.env_s += time.perf_counter() - clock

        self.rollout["reward"][t] = reward
        self.rollout["terminated"][t] = terminated
        self.rollout["truncated"][t] = truncated
        self._record_episodes(t, info)
        self.obs = np.asarray(obs, dtype=np.float32)
        self.next_step_valid = ~(terminated | truncated)

    def _record_episodes(self, t: int, info: dict) -> None:
        episode = info.get("episode")
        if episode is None:
            self.rollout["episode_done"][t] = False
            return
        finished = info["_episode"]
        self.rollout["episode_done"][t] = finished
        self.rollout["episode_return"][t] = np.where(finished, episode["r"], 0.0)
        self.rollout["episode_length"][t] = np.where(finished, episode["l"], 0)

    def send_segment(self) -> None:
        self.segment["next_obs"].numpy()[:] = self.obs
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
