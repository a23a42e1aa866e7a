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
from spmd_rl.comm.local_channel import local_channel
from spmd_rl.config.loading import load_config
from spmd_rl.envs.backend import backend_for
from spmd_rl.envs.vector import probe_env
from spmd_rl.interfaces.policy import Policy, StepField
from spmd_rl.roles.env_runner import EnvRunner
from spmd_rl.roles.inference_server import InferenceServer
from spmd_rl.roles.messages import action_message, observation_message, segment_message
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


class ReachExpert(ScriptedExpert):
    """InstructedReach-v0's expert: each action of a chunk steps straight towards the named target (at most 1 per
    axis), from where the chunk's earlier actions took the point."""

    def actions(self, obs) -> torch.Tensor:
        words = obs["instruction"]["ids"].numpy()
        targets = np.stack([TARGETS["red"] if WORDS.index("red") in row else TARGETS["blue"] for row in words])
        position = obs["state"].numpy().copy()
        chunk = []
        for _ in range(self.action_space.shape[0]):
            action = np.clip((targets - position) / STEP, -1.0, 1.0)
            position = np.clip(position + STEP * action, -1.0, 1.0)
            chunk.append(action)
        return torch.from_numpy(np.stack(chunk, 1).astype(np.float32))


def collect(run_dir: Path, overrides: list[str], expert_cls: type[ScriptedExpert], rollouts: int) -> Path:
    """`rollouts` rollouts of algo.num_steps decisions of env.num_envs envs acted by the expert, appended to
    run_dir/buffer/experience_rank0.h5 (as buffer.log_experience logs them); returns that file."""
    cfg = load_config(None, overrides)
    spec = probe_env(cfg.env)
    expert = expert_cls(spec.observation_space, spec.action_space, None)
    outputs = expert.outputs()
    n, t = cfg.env.num_envs, cfg.algo.num_steps
    envs, first_obs = backend_for(cfg.env).make(cfg.env, spec, cfg.train.seed)
    obs_out, obs_in = local_channel("observations", observation_message(spec, n))
    actions_out, actions_in = local_channel("actions", action_message(outputs, n))
    segments_out, segments_in = local_channel("segments", segment_message(spec, outputs, t, n))
    runner = EnvRunner(
        envs,
        first_obs,
        obs_out,
        actions_in,
        segments_out,
        t,
        list(outputs),
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
