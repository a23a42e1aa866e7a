"""Instructed reach: a 2-D arm, three coloured targets, and an instruction naming the one to reach.

    env.id: reach_env:InstructedReach-v0   (importing this module registers it; run from this folder)

The observation is what a robot-manipulation env gives a VLA policy: a 16 x 16 x 3 uint8 camera image (the three
targets as coloured 2 x 2 squares, the arm's tip as a white one), the arm's state (its x, y in [-1, 1]) and a
gymnasium `Text` instruction, "reach the red target" (or green, or blue). Every episode starts the arm near the
centre and names one target at random, so neither the image nor the state says which target is meant: only the
instruction does. An action is a 2-D velocity in [-1, 1] (clipped); each step moves the tip by `speed` times it.
The episode ends (terminated) when the tip comes within `radius` of any target: of the named one, with reward 1
and info["success"] True; of another, as a failure (reward 0), so that no policy can succeed by visiting every
target in turn, and one that ignores the instruction succeeds about a third of the time. An episode that reaches
no target runs until the config's env.max_episode_steps truncates it.

kwargs: `blank_instruction` (every instruction reads "reach the target": the control that shows the instruction
matters), `speed`, `radius`.
"""

from __future__ import annotations

import string

import gymnasium as gym
import numpy as np

# Each colour's place in the arena ([-1, 1] x [-1, 1], y up) and how the image draws it; fixed, so that learning
# to read the instruction, not to find the colour in the image, is what this example costs.
TARGETS = {
    "red": ((-0.6, 0.5), (255, 0, 0)),
    "green": ((0.6, 0.5), (0, 255, 0)),
    "blue": ((0.0, -0.7), (0, 0, 255)),
}
IMAGE_SIZE = 16
ARM_COLOUR = (255, 255, 255)
START_SPREAD = 0.2  # the arm starts uniformly in [-0.2, 0.2]^2


def pixel(position: np.ndarray) -> tuple[int, int]:
    """The (row, column) of the 2 x 2 square's top-left pixel that draws a point of the arena."""
    column = int(np.clip((position[0] + 1) / 2 * (IMAGE_SIZE - 2), 0, IMAGE_SIZE - 2))
    row = int(np.clip((1 - position[1]) / 2 * (IMAGE_SIZE - 2), 0, IMAGE_SIZE - 2))
    return row, column


class InstructedReach(gym.Env):
    def __init__(self, blank_instruction: bool = False, speed: float = 0.2, radius: float = 0.3):
        self.observation_space = gym.spaces.Dict(
            {
                "image": gym.spaces.Box(0, 255, (IMAGE_SIZE, IMAGE_SIZE, 3), dtype=np.uint8),
                "state": gym.spaces.Box(-1.0, 1.0, (2,), dtype=np.float32),
                "instruction": gym.spaces.Text(max_length=32, charset=string.ascii_lowercase + " "),
            }
        )
        self.action_space = gym.spaces.Box(-1.0, 1.0, (2,), dtype=np.float32)
        self.blank_instruction = blank_instruction
        self.speed = speed
        self.radius = radius
        self.colours = list(TARGETS)
        self.target = self.colours[0]
        self.arm = np.zeros(2, dtype=np.float32)
        self.background = np.zeros((IMAGE_SIZE, IMAGE_SIZE, 3), dtype=np.uint8)
        for place, colour in TARGETS.values():
            row, column = pixel(np.array(place))
            self.background[row : row + 2, column : column + 2] = colour

    def _observation(self) -> dict:
        image = self.background.copy()
        row, column = pixel(self.arm)
        image[row : row + 2, column : column + 2] = ARM_COLOUR
        instruction = "reach the target" if self.blank_instruction else f"reach the {self.target} target"
        return {"image": image, "state": self.arm.copy(), "instruction": instruction}

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.target = self.colours[int(self.np_random.integers(len(self.colours)))]
        self.arm = self.np_random.uniform(-START_SPREAD, START_SPREAD, 2).astype(np.float32)
        return self._observation(), {}

    def step(self, action):
        velocity = np.clip(np.asarray(action, dtype=np.float32), -1.0, 1.0)
        self.arm = np.clip(self.arm + self.speed * velocity, -1.0, 1.0).astype(np.float32)
        reached = [colour for colour, (place, _) in TARGETS.items() if np.linalg.norm(self.arm - place) <= self.radius]
        success = self.target in reached
        return self._observation(), float(success), bool(reached), False, {"success": success}


gym.register(id="InstructedReach-v0", entry_point=InstructedReach)
