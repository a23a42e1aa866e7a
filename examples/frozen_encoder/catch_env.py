"""Catch (as in DeepMind's bsuite), drawn into a small uint8 image: a ball falls one row per step from a random
column of the top row; a paddle on the bottom row moves left, stays or moves right. When the ball reaches the bottom
row the episode ends with +1 if the paddle is under it, else -1.

Importing this module registers `Catch-v0`, so the config names the env `catch_env:Catch-v0` (gymnasium imports
the module before making the env). Observations are rows x columns x 1, uint8: 255 where the ball or the paddle is.
"""

import gymnasium as gym
import numpy as np

LEFT, STAY, RIGHT = 0, 1, 2


class Catch(gym.Env):
    metadata = {"render_modes": []}

    def __init__(self, rows: int = 10, columns: int = 5):
        if rows < 2 or columns < 1:
            raise ValueError(f"Catch needs rows >= 2 and columns >= 1, got rows={rows}, columns={columns}")
        self.rows, self.columns = rows, columns
        self.observation_space = gym.spaces.Box(0, 255, (rows, columns, 1), np.uint8)
        self.action_space = gym.spaces.Discrete(3)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.ball_row = 0
        self.ball_column = int(self.np_random.integers(self.columns))
        self.paddle = self.columns // 2
        return self._frame(), {}

    def step(self, action):
        self.paddle = min(max(self.paddle + int(action) - STAY, 0), self.columns - 1)
        self.ball_row += 1
        terminated = self.ball_row == self.rows - 1
        reward = (1.0 if self.paddle == self.ball_column else -1.0) if terminated else 0.0
        return self._frame(), reward, terminated, False, {}

    def _frame(self) -> np.ndarray:
        frame = np.zeros((self.rows, self.columns, 1), np.uint8)
        frame[self.ball_row, self.ball_column] = 255
        frame[self.rows - 1, self.paddle] = 255
        return frame


if "Catch-v0" not in gym.registry:  # importing twice (probe, then the vector env) must not re-register
    gym.register(id="Catch-v0", entry_point="catch_env:Catch")
