"""Demonstrations for bc's tests and benchmark: a scripted expert acts on a config's real envs through the framework's
own env runner and inference server (local channels, as the colocated layout joins them), and every rollout is
appended to an experience log, the HDF5 format bc reads.

    collect(run_dir, overrides, ReachExpert, rollouts=4)   -> run_dir/buffer/experience_rank0.h5

`ReachExpert` is the expert of `tests.harness.vla_fixtures:InstructedReach-v0` (it reads the target from the
instruction's ids); an expert for another env is a Policy whose act() returns its actions (and zeros for the rest).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from harness.vla_fixtures import TARGETS, WORDS
from spmd_rl.config.loading import load_config
from spmd_rl.envs.backend import backend_for
from spmd_rl.envs.vector import probe_env
from spmd_rl.interfaces.policy import Policy, StepField
from spmd_rl.roles.inference_server import InferenceServer
from spmd_rl.roles.local_env_runner import local_env_runner
from spmd_rl.roles.messages import segment_message
from spmd_rl.storage.experience_log import ExperienceLog

STEP = 0.2  # InstructedReach-v0 moves its point by 0.2 x the action


class ScriptedExpert(Policy):
    """A policy with no weights that acts as a script says: outputs() declares the action alone."""

    def outputs(self) -> dict[str, StepField]:
        return {"action": StepField(tuple(self.action_space.shape), torch.float32)}

    def act(self, obs, deterministic: bool = False) -> dict[str, torch.Tensor]:
        return {"action": self.actions(obs)}

    def actions(self, obs) -> torch.Tensor:
        raise NotImplementedError


def chunk_towards(targets: np.ndarray, position: np.ndarray, step: float, length: int) -> torch.Tensor:
    """A reaching expert's chunk of `length` actions per env ([N, length, dims], float32): each points straight at
    the env's target (at most 1 per axis) from where the chunk's earlier actions took the point, which an action
    moves by step x the action and the env keeps in [-1, 1]."""
    chunk = []
    for _ in range(length):
        action = np.clip((targets - position) / step, -1.0, 1.0)
        position = np.clip(position + step * action, -1.0, 1.0)
        chunk.append(action)
    return torch.from_numpy(np.stack(chunk, 1).astype(np.float32))


class ReachExpert(ScriptedExpert):
    """InstructedReach-v0's expert: each action of a chunk steps straight towards the named target (at most 1 per
    axis), from where the chunk's earlier actions took the point."""

    def actions(self, obs) -> torch.Tensor:
        words = obs["instruction"]["ids"].numpy()
        targets = np.stack([TARGETS["red"] if WORDS.index("red") in row else TARGETS["blue"] for row in words])
        return chunk_towards(targets, obs["state"].numpy(), STEP, self.action_space.shape[0])


def collect(run_dir: Path, overrides: list[str], expert_cls: type[ScriptedExpert], rollouts: int) -> Path:
    """`rollouts` rollouts of algo.num_steps decisions of env.num_envs envs acted by the expert, appended to
    run_dir/buffer/experience_rank0.h5 (as buffer.log_experience logs them); returns that file."""
    cfg = load_config(None, overrides)
    spec = probe_env(cfg.env)
    expert = expert_cls(spec.observation_space, spec.action_space, None)
    outputs = expert.outputs()
    n, t = cfg.env.num_envs, cfg.algo.num_steps
    envs, first_obs = backend_for(cfg.env).make(cfg.env, spec, cfg.train.seed)
    runner, obs_in, actions_out, segments_in = local_env_runner(
        envs,
        first_obs,
        spec,
        outputs,
        t,
        env_id=cfg.env.id,
        env_backend=backend_for(cfg.env),
        success_key=spec.success_key,
    )
    server = InferenceServer(expert, [obs_in], [actions_out], torch.device("cpu"))
    log = ExperienceLog(run_dir, 0, segment_message(spec, outputs, t, n)["rollout"])
    try:
        for rollout in range(rollouts):
            for step in range(t):
                runner.send_observations(step)
                server.serve_step()
                runner.receive_actions_and_step(step)
            runner.send_segment()
            log.append(segments_in.irecv().wait()["rollout"], policy_version=-1, env_step=rollout * t * n)
    finally:
        log.close()
        runner.close()
    return log.path
