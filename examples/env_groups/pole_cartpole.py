"""CartPole with a pole length of your choice: task variants for env groups.

gymnasium's CartPole takes no length argument; its physics reads `length` (half the pole's length, 0.5 in
CartPole-v1) and `polemass_length` (the pole's mass times that length) on every step. Importing this module
registers `PoleCartPole-v1` (500-step episodes, as CartPole-v1) taking `length`, so a config names the env
`examples.env_groups.pole_cartpole:PoleCartPole-v1` with `kwargs: {length: 1.0}` (per group, see
configs/ppo_cartpole_groups.yaml). The env made is gymnasium's own CartPoleEnv, so checkpoints save its state
as they save CartPole-v1's and a resume continues its episodes exactly.
"""

import gymnasium as gym
from gymnasium.envs.classic_control.cartpole import CartPoleEnv


def make_pole_cartpole(length: float = 0.5, **kwargs) -> gym.Env:
    env = CartPoleEnv(**kwargs)
    env.length = length
    env.polemass_length = env.masspole * length
    return env


gym.register("PoleCartPole-v1", entry_point=make_pole_cartpole, max_episode_steps=500, reward_threshold=475.0)
