"""An env factory as SB3 and CleanRL users write one, for env.id=tests.harness.env_factories:make_cartpole."""

import gymnasium as gym


def make_cartpole(**kwargs):
    """CartPole with a shorter episode limit (kwargs come from env.kwargs)."""
    return gym.make("CartPole-v1", max_episode_steps=kwargs.pop("limit", 500), **kwargs)
