"""A user's env backend, `env.backend: torch_cartpole:TorchCartPoleBackend`: CartPole written in torch, every env
of a rank stepped as one batch of tensors, in the shape GPU simulators hand out (rsl_rl's `VecEnv`: batched
tensors on the envs' device, time-outs apart from terminations).

`TorchCartPole` is the simulator: gymnasium's CartPole-v1 equations (Euler steps of 0.02 s, a pole of half-length
0.5, termination past 12 degrees or 2.4 m), with `step(actions) -> (obs, reward, terminated, truncated)` as
tensors and no autoreset of its own. `TorchCartPoleBackend` is what the framework asks of a backend (see
spmd_rl/envs/backend.py): the spaces, a rank's vector env (NEXT_STEP autoreset and episode statistics, as
gymnasium's vector envs give them), the step limit, an evaluation's shorter limit, and the envs' state for
checkpoints (a resume continues every episode exactly). The env runner reads numpy: on the CPU the tensors are
handed over as numpy views of the same memory, without a copy.
"""

from __future__ import annotations

import dataclasses
import math

import gymnasium as gym
import numpy as np
import torch

from spmd_rl.api import EnvBackend, EnvSpec, UserError, finish_vector_env

HIGH = np.array([4.8, np.finfo(np.float32).max, 0.2095 * 2, np.finfo(np.float32).max], dtype=np.float32)
OBSERVATION_SPACE = gym.spaces.Box(-HIGH, HIGH, dtype=np.float32)
ACTION_SPACE = gym.spaces.Discrete(2)
MAX_EPISODE_STEPS = 500  # CartPole-v1's


class TorchCartPole:
    """num_envs cart-poles as one batch of tensors on `device`."""

    gravity, masscart, masspole, length, force_mag, tau = 9.8, 1.0, 0.1, 0.5, 10.0, 0.02
    theta_threshold, x_threshold = 12 * 2 * math.pi / 360, 2.4

    def __init__(self, num_envs: int, max_episode_steps: int, seed: int, device: str = "cpu"):
        self.num_envs, self.max_episode_steps, self.device = num_envs, max_episode_steps, torch.device(device)
        self.generator = torch.Generator(self.device).manual_seed(seed)
        self.state = torch.zeros(num_envs, 4, device=self.device)
        self.steps = torch.zeros(num_envs, dtype=torch.int64, device=self.device)

    def reset(self, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Reset the envs in `mask` (all by default); the observations of all."""
        mask = torch.ones(self.num_envs, dtype=torch.bool, device=self.device) if mask is None else mask
        fresh = torch.rand(self.num_envs, 4, generator=self.generator, device=self.device) * 0.1 - 0.05
        self.state = torch.where(mask[:, None], fresh, self.state)
        self.steps = torch.where(mask, 0, self.steps)
        return self.state

    def step(self, actions: torch.Tensor):
        x, x_dot, theta, theta_dot = self.state.unbind(1)
        force = torch.where(actions == 1, self.force_mag, -self.force_mag)
        cos, sin = torch.cos(theta), torch.sin(theta)
        total_mass, polemass_length = self.masscart + self.masspole, self.masspole * self.length
        temp = (force + polemass_length * theta_dot**2 * sin) / total_mass
        theta_acc = (self.gravity * sin - cos * temp) / (
            self.length * (4.0 / 3.0 - self.masspole * cos**2 / total_mass)
        )
        x_acc = temp - polemass_length * theta_acc * cos / total_mass
        self.state = torch.stack(
            (
                x + self.tau * x_dot,
                x_dot + self.tau * x_acc,
                theta + self.tau * theta_dot,
                theta_dot + self.tau * theta_acc,
            ),
            dim=1,
        )
        self.steps += 1
        terminated = (self.state[:, 0].abs() > self.x_threshold) | (self.state[:, 2].abs() > self.theta_threshold)
        truncated = (self.steps >= self.max_episode_steps) & ~terminated
        reward = torch.ones(self.num_envs, device=self.device)
        return self.state, reward, terminated, truncated


class TorchCartPoleVectorEnv(gym.vector.VectorEnv):
    """TorchCartPole behind gymnasium's VectorEnv API, with NEXT_STEP autoreset (the step after an episode's end
    only resets that env: reward 0, its action ignored) and RecordEpisodeStatistics' info["episode"]."""

    metadata = {"autoreset_mode": gym.vector.AutoresetMode.NEXT_STEP}

    def __init__(self, num_envs: int, max_episode_steps: int, seed: int, device: str = "cpu"):
        self.sim = TorchCartPole(num_envs, max_episode_steps, seed, device)
        self.num_envs = num_envs
        self.single_observation_space, self.single_action_space = OBSERVATION_SPACE, ACTION_SPACE
        self.observation_space = gym.vector.utils.batch_space(OBSERVATION_SPACE, num_envs)
        self.action_space = gym.vector.utils.batch_space(ACTION_SPACE, num_envs)
        self.resets_next = torch.zeros(num_envs, dtype=torch.bool)
        self.returns = torch.zeros(num_envs, dtype=torch.float64)
        self.lengths = torch.zeros(num_envs, dtype=torch.int64)

    def reset(self, *, seed=None, options=None):
        if seed is not None:
            self.sim.generator.manual_seed(seed)
        self.resets_next[:] = False
        self.returns[:], self.lengths[:] = 0, 0
        return _numpy(self.sim.reset()), {}

    def step(self, actions):
        actions = torch.as_tensor(actions, device=self.sim.device)
        resetting = self.resets_next
        _, reward, terminated, truncated = self.sim.step(actions)
        if resetting.any():  # NEXT_STEP: these envs only reset this step
            obs = self.sim.reset(resetting)
            reward = torch.where(resetting, 0.0, reward)
            terminated, truncated = terminated & ~resetting, truncated & ~resetting
        else:
            obs = self.sim.state
        counted = ~resetting
        self.returns += torch.where(counted, reward.double(), 0.0)
        self.lengths += counted.long()
        done = terminated | truncated
        info = {}
        if done.any():
            info["episode"] = {
                "r": _numpy(torch.where(done, self.returns, 0.0)),
                "l": _numpy(torch.where(done, self.lengths, 0)),
            }
            info["_episode"] = _numpy(done)
            self.returns[done], self.lengths[done] = 0, 0
        self.resets_next = done
        return _numpy(obs), _numpy(reward), _numpy(terminated), _numpy(truncated), info

    def state_dict(self) -> dict:
        return {
            "state": self.sim.state.cpu().clone(),
            "steps": self.sim.steps.cpu().clone(),
            "generator": self.sim.generator.get_state(),
            "resets_next": self.resets_next.clone(),
            "returns": self.returns.clone(),
            "lengths": self.lengths.clone(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.sim.state = state["state"].to(self.sim.device)
        self.sim.steps = state["steps"].to(self.sim.device)
        self.sim.generator.set_state(state["generator"])
        self.resets_next, self.returns, self.lengths = state["resets_next"], state["returns"], state["lengths"]


def _numpy(tensor: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor (no copy); a device tensor is copied to the CPU once."""
    return tensor.detach().cpu().numpy()


class TorchCartPoleBackend(EnvBackend):
    """env.id: TorchCartPole-v0; env.kwargs: max_episode_steps (default 500), device (default cpu)."""

    takes_groups = False
    groups_refusal = "one TorchCartPole batch runs one setting"

    def probe(self, cfg) -> EnvSpec:
        unknown = set(cfg.kwargs) - {"max_episode_steps", "device"}
        if cfg.id != "TorchCartPole-v0" or unknown:
            raise UserError(
                f"env.backend=torch_cartpole:TorchCartPoleBackend runs env.id TorchCartPole-v0 with env.kwargs "
                f"max_episode_steps and device; got env.id '{cfg.id}', unknown kwargs {sorted(unknown)}"
            )
        return EnvSpec(cfg.id, OBSERVATION_SPACE, ACTION_SPACE, "torch")

    def make(self, cfg, spec, seed, wrappers=None):
        if wrappers:
            raise UserError("TorchCartPole takes no per-env gymnasium wrappers")
        envs = TorchCartPoleVectorEnv(cfg.num_envs, self.step_limit(cfg), seed, device=cfg.kwargs.get("device", "cpu"))
        return finish_vector_env(envs, cfg, seed, reset_seed=seed)

    def step_limit(self, cfg) -> int:
        return int(cfg.kwargs.get("max_episode_steps", MAX_EPISODE_STEPS))

    def limit_steps(self, cfg, spec, max_steps):
        return dataclasses.replace(cfg, kwargs={**cfg.kwargs, "max_episode_steps": max_steps}), spec, []

    def capture_state(self, envs):
        if _normalizes_reward(envs):
            return None
        return {"envs": _base(envs).state_dict(), "action_space_rng": envs.action_space.np_random.bit_generator.state}

    def restore_state(self, envs, state):
        _base(envs).load_state_dict(state["envs"])
        envs.action_space.np_random.bit_generator.state = state["action_space_rng"]

    def unsaved_reason(self, envs):
        if _normalizes_reward(envs):
            return "env.normalize_reward's statistics are not saved by this backend: a resume begins fresh episodes"
        return None


def _normalizes_reward(envs) -> bool:
    while not isinstance(envs, TorchCartPoleVectorEnv):
        if isinstance(envs, gym.wrappers.vector.NormalizeReward):
            return True
        envs = envs.env
    return False


def _base(envs) -> TorchCartPoleVectorEnv:
    while not isinstance(envs, TorchCartPoleVectorEnv):
        envs = envs.env
    return envs
