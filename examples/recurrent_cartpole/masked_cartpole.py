"""CartPole with its velocities hidden: a partially observed task that needs memory.

CartPole-v1's observation is (cart position, cart velocity, pole angle, pole angular velocity). This wrapper keeps
the two positions only, so a policy sees where the cart and the pole are but not where they are going: a
feed-forward policy must act on a guess, while a recurrent one can infer the velocities from consecutive
positions. Importing this module registers `MaskedCartPole-v1` (500-step episodes, as CartPole-v1), so a config
names the env `masked_cartpole:MaskedCartPole-v1` (gymnasium imports the module before making the env).
"""

import gymnasium as gym
import numpy as np

POSITIONS = [0, 2]  # cart position and pole angle; 1 and 3 are their velocities


class HideVelocities(gym.ObservationWrapper):
    """Observations reduced to the positions (cart position, pole angle)."""

    def __init__(self, env: gym.Env):
        super().__init__(env)
        low, high = env.observation_space.low[POSITIONS], env.observation_space.high[POSITIONS]
        self.observation_space = gym.spaces.Box(low, high, dtype=np.float32)

    def observation(self, observation: np.ndarray) -> np.ndarray:
        return observation[POSITIONS]


def make_masked_cartpole(**kwargs) -> gym.Env:
    return HideVelocities(gym.make("CartPole-v1", **kwargs).unwrapped)


gym.register("MaskedCartPole-v1", entry_point=make_masked_cartpole, max_episode_steps=500)
