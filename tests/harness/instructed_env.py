"""A small instructed task: a Dict observation of a camera image, the agent's state and a Text instruction, and a
success flag in the step info, as robot-manipulation envs give them.

    env.id=tests.harness.instructed_env:Instructed-v0   (the repository root on PYTHONPATH or as the working directory)

Each episode names one of two targets in its instruction ("reach the red target" / "reach the blue target"); the
image and the state are the same for both, so only the instruction tells which action is right. An episode is
EPISODE_STEPS steps; each step rewards (and reports info["success"] for) the action that picks the named target.
kwargs: `instruction_suffix` (appended to every instruction: a long one exceeds env.max_text_tokens), `success_key`
(the info key of the flag).
"""

from __future__ import annotations

import string

import gymnasium as gym
import numpy as np

TARGETS = ("red", "blue")
EPISODE_STEPS = 4


class InstructedEnv(gym.Env):
    def __init__(self, instruction_suffix: str = "", success_key: str = "success"):
        self.observation_space = gym.spaces.Dict(
            {
                "image": gym.spaces.Box(0, 255, (8, 8, 3), dtype=np.uint8),
                "state": gym.spaces.Box(-1.0, 1.0, (2,), dtype=np.float32),
                "instruction": gym.spaces.Text(max_length=200, charset=string.ascii_letters + string.digits + " .,"),
            }
        )
        self.action_space = gym.spaces.Discrete(len(TARGETS))
        self.suffix = instruction_suffix
        self.success_key = success_key
        self.target = 0
        self.steps = 0

    def _observation(self) -> dict:
        image = np.full((8, 8, 3), 40 * self.steps, dtype=np.uint8)
        state = np.array([self.steps / EPISODE_STEPS, 0.0], dtype=np.float32)
        instruction = f"reach the {TARGETS[self.target]} target{self.suffix}"
        return {"image": image, "state": state, "instruction": instruction}

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.target = int(self.np_random.integers(len(TARGETS)))
        self.steps = 0
        return self._observation(), {}

    def step(self, action):
        self.steps += 1
        success = int(action) == self.target
        truncated = self.steps >= EPISODE_STEPS
        return self._observation(), float(success), False, truncated, {self.success_key: success}


if "Instructed-v0" not in gym.registry:  # imported as harness.instructed_env and as tests.harness.instructed_env
    gym.register(id="Instructed-v0", entry_point=InstructedEnv)
