"""An env rank's envs in pipeline stages (env.pipeline_stages S > 1): while the inference rank acts for one stage,
the env rank steps another, so env time and inference time overlap instead of adding up.

Each stage is an EnvRunner of its own: its own vector env (N / S envs, seeded as those envs are seeded in one
stage), its own observation and action channels to the inference rank, and its own columns of the one segment that
goes to the trainer (the trainer sees the same [T, N] segment as with one stage). The order is fixed: every stage
sends its first observations, then per step each stage in turn receives its actions, steps, and sends its next
observations, so stage s + 1's observations are being acted on while stage s steps. The inference rank serves the
stages in the same order (InferenceServer.serve_step), so the schedule still follows from the config alone.
"""

from __future__ import annotations

from collections.abc import Callable

from spmd_rl.roles.env_runner import EnvRunner, draw_episode_seed, send_segment


def stage_columns(num_envs: int, stages: int) -> list[slice]:
    """Each stage's envs among an env rank's `num_envs` (columns of its segment): equal consecutive blocks, so a
    block of env.group_size envs (which the plan makes divide a stage) lies in one stage."""
    size = num_envs // stages
    return [slice(s * size, (s + 1) * size) for s in range(stages)]


def stage_seed(seed: int, columns: slice, group_size: int) -> int:
    """The first seed of a stage's envs, where `seed` is the env rank's: env i of the rank resets with seed + i (or
    seed + i // group_size, a group's), in one stage or several (envs/backend.py's group_seeds)."""
    return seed + columns.start // group_size


class PipelinedEnvRunner:
    def __init__(self, stages: list[EnvRunner], to_trainer, num_envs: int):
        self.stages = stages
        self.to_trainer = to_trainer
        self.num_envs = num_envs  # the env rank's envs, every stage's together
        self.num_steps = stages[0].num_steps
        self.episodes = stages[0].episodes
        self.env_backend = stages[0].env_backend
        self.envs = stages[0].envs  # what a backend's unsaved_reason looks at: every stage's envs are alike

    def collect_segment(self, index: int) -> None:
        """One rollout of every stage, interleaved, then the segment to the trainer (see the module docstring)."""
        self._begin_segment(index)
        for stage in self.stages:
            stage.send_observations(0)
        for t in range(self.num_steps):
            for stage in self.stages:
                stage.receive_actions_and_step(t)
                if t + 1 < self.num_steps:
                    stage.send_observations(t + 1)
        self.send_segment()

    def collect_segment_in_process(self, index: int, serve_stage: Callable[[int], None]) -> None:
        """One rollout where the inference server runs in this process (the colocated layout) and each stage steps
        on its own thread (EnvStepThread): per step, stage by stage, the stage's previous step is finished, its
        observations go out, `serve_stage(s)` acts for them (while the other stages step) and its step begins."""
        self._begin_segment(index)
        for t in range(self.num_steps):
            for s, stage in enumerate(self.stages):
                if t:
                    stage.finish_step(t - 1)
                stage.send_observations(t)
                serve_stage(s)
                stage.receive_actions_and_start_step(t)
        for stage in self.stages:
            stage.finish_step(self.num_steps - 1)
        self.send_segment()

    def _begin_segment(self, index: int) -> None:
        for stage in self.stages:
            stage.mark_segment(index)
        if self.episodes:
            # One draw for the env rank, as with one stage: stage s's envs take the seeds its columns take there.
            seed = draw_episode_seed(self.num_envs)
            for stage in self.stages:
                assert stage.columns is not None  # every stage has its columns (build_env_runner)
                stage.episode_seed = stage_seed(seed, stage.columns, stage.group_size)

    def send_segment(self) -> None:
        send_segment(self.to_trainer, self.stages)

    def state_dict(self) -> dict:
        """Each stage's state (its envs' own state and its place between rollouts), in stage order."""
        return {"stages": [stage.state_dict() for stage in self.stages]}

    def load_state_dict(self, state: dict) -> None:
        for stage, stage_state in zip(self.stages, state["stages"], strict=True):
            stage.load_state_dict(stage_state)

    def close(self) -> None:
        for stage in self.stages:
            stage.close()
