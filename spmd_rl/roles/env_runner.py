"""The env runner: steps its envs with actions from its inference server, records the rollout, and hands each
finished rollout segment to its trainer.

One step is two halves (send observations / receive actions and step) so that in the colocated layout the
inference server can run in between, in the same process, through local channels (roles/local_env_runner.py).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import numpy as np
import torch

from spmd_rl.envs import spaces
from spmd_rl.envs.backend import EnvBackend, check_group_starts, group_seeds, old_gym_api_hint
from spmd_rl.envs.chunks import CHUNK_REWARDS, executed_steps
from spmd_rl.envs.env_workers import close_envs, worker_death
from spmd_rl.envs.gymnasium_state import as_arrays, as_tensors
from spmd_rl.envs.success import EpisodeSuccess
from spmd_rl.interfaces.policy import ACTIVE, CHUNK_VALID, EPISODE_START, RECURRENT_STATE, SUCCESS_FIELDS
from spmd_rl.roles.env_step_thread import EnvStepThread
from spmd_rl.runtime.errors import UserCodeError, UserError, describe_exception
from spmd_rl.runtime.watchdog import watchdog


class EnvRunner:
    def __init__(
        self,
        envs,
        first_obs,
        to_inference,
        from_inference,
        to_trainer,
        num_steps: int,
        policy_outputs: list[str],
        describe: str = "env runner",
        env_id: str = "env",
        env_backend: EnvBackend | None = None,
        success_key: str | None = None,
        group_size: int = 1,
        columns: slice | None = None,
        stage: str = "",
        step_thread: EnvStepThread | None = None,
        hang_advice: str = "",
    ):
        """`columns`: where this runner's envs lie in the segment, when it is one stage of a PipelinedEnvRunner
        (which sends the segment); None: the whole segment, sent by this runner. `stage` names the stage in its
        errors (' in pipeline stage 1'; '' without stages). `hang_advice`: the end of the watchdog's line when a
        step hangs (EnvBackend.hang_advice). `step_thread`: the thread that steps the envs while
        this process acts for another stage (pipeline stages in one process); None: steps on the caller's thread."""
        self.envs = envs
        self.step_thread = step_thread
        self._action = None  # the actions of the step begun and not yet finished
        self.env_backend = env_backend  # what saves and restores the envs' state (None: checkpoints hold none)
        self.num_steps = num_steps
        self.to_inference = to_inference
        self.from_inference = from_inference
        self.to_trainer = to_trainer
        self.policy_outputs = policy_outputs  # the fields of each reply copied into the rollout (action first)
        self.describe = describe + stage
        self.env_id = env_id
        self.watched_step = watchdog.watch(f"env.step of {env_id}{stage}{hang_advice}")  # made once: entered every step
        # Both outgoing buffers are written in place, so the channels send them without another copy. The writes
        # go through numpy views of the (CPU) buffers: a numpy assignment costs a fraction of a torch op's
        # dispatch, and this loop runs once per env step. Observations keep the env's dtype and shape (nested
        # dicts of views for Dict spaces).
        self.obs_out = spaces.numpy_views(to_inference.buffer["obs"])
        self.segment = to_trainer.buffer
        self.columns = columns
        self.rollout = {
            key: _columns_of(spaces.numpy_views(value), columns, axis=1)
            for key, value in self.segment["rollout"].items()
        }
        self.next_obs_out = _columns_of(spaces.numpy_views(self.segment["next_obs"]), columns, axis=0)
        self.versions = self.segment["policy_version"].numpy()
        # The async engine's observations carry the index of the segment they belong to (see collect_segment).
        message = to_inference.buffer
        self.segment_index = message["segment"].numpy() if "segment" in message.keys() else None
        self._reply_views: dict[int, tuple] = {}
        # A recurrent policy's observations say where an episode starts (the inference server resets the state
        # there), and its segments carry the state the first step acted from. For a stateless policy neither
        # exists and the step does no work for them.
        self.recurrent = EPISODE_START in message.keys()
        if self.recurrent:
            self.episode_start_out = message[EPISODE_START].numpy()
            self.first_state = _columns_of(spaces.numpy_views(self.segment[RECURRENT_STATE]), columns, axis=0)
            self.next_step_starts = np.ones(envs.num_envs, dtype=bool)  # the first observations start episodes
        # Each episode's success (env.success_key in the step info), where the env reports it (EnvSpec.success_key).
        self.success = EpisodeSuccess(success_key, envs.num_envs) if success_key is not None else None
        # With action chunks (env.action_chunk > 1) every decision records its K rewards and which of them ran,
        # and episode lengths count primitive steps (the vector env's statistics count decisions).
        self.chunked = CHUNK_VALID in self.rollout
        if self.chunked:
            self.chunk_steps = np.arange(self.rollout[CHUNK_VALID].shape[-1])
            self.episode_primitive_steps = np.zeros(envs.num_envs, dtype=np.int64)
        # Rollouts of whole episodes (the segment has an active mask): every rollout starts each env from a reset,
        # one seed per block of env.group_size envs (group_size), so that a group starts together every rollout.
        self.episodes = ACTIVE in self.rollout
        if self.episodes:
            self.active = np.ones(envs.num_envs, dtype=bool)
            self.group_size = group_size
            # A stage's first seed of the next rollout, set by its PipelinedEnvRunner from the one draw of the env
            # rank (so a rank's envs reset as they would in one stage); None: drawn here.
            self.episode_seed: int | None = None
        self.obs = first_obs
        self.steps_taken = 0
        spaces.check_finite(self.describe, self.env_id, first_obs, None, "reset")
        self.obs_is_float_array = isinstance(first_obs, np.ndarray) and np.issubdtype(first_obs.dtype, np.floating)
        # After a step that ends an episode, the next step only resets that env: its transition is not real.
        self.next_step_valid = np.ones(envs.num_envs, dtype=bool)
        self._reset_timers()

    def _reset_timers(self):
        self.env_s = self.action_wait_s = self.inference_s = self.inference_idle_s = 0.0
        self.rollout_clock = time.perf_counter()  # a rollout's time runs from the previous segment sent

    def send_observations(self, t: int) -> None:
        self.to_inference.wait()  # the observations go out with isend: the previous ones are out of the buffer
        if self.episodes:
            if t == 0:
                self._start_episodes()
            self.rollout[ACTIVE][t] = self.active
        spaces.write(self.rollout["obs"], self.obs, t)
        self.rollout["valid"][t] = self.next_step_valid
        spaces.write(self.obs_out, self.obs)
        if self.recurrent:
            self.rollout[EPISODE_START][t] = self.next_step_starts
            self.episode_start_out[:] = self.next_step_starts
        # The reply's receive is posted before the observation goes out: with gloo, a reply that arrives before
        # its receive is posted waits a round trip more whenever this process wakes late (async engine, busy cores).
        self._reply = self.from_inference.irecv()
        self.to_inference.isend()

    def receive_actions_and_step(self, t: int) -> None:
        self.receive_actions_and_start_step(t)
        self.finish_step(t)

    def receive_actions_and_start_step(self, t: int) -> None:
        """Step t's first half: its actions into the rollout, and the step begun (on the step thread, if any)."""
        # Only the time this rank waits counts: a pipeline stage's actions are computed while other stages step.
        clock = time.perf_counter()
        reply = self._numpy_views(self._reply.wait())
        self.action_wait_s += time.perf_counter() - clock
        self.inference_s += float(reply["inference_s"][0])
        self.inference_idle_s += float(reply["idle_s"][0])
        for key in self.policy_outputs:
            self.rollout[key][t] = reply[key]
        action = self.rollout["action"][t]
        if self.columns is None or self.columns.start == 0:
            self.versions[t] = reply["policy_version"][0]
        else:  # a later pipeline stage, which async serving may have answered with other weights: the oldest counts
            self.versions[t] = min(self.versions[t], reply["policy_version"][0])
        if self.recurrent:
            if t == 0:  # where the learner's replay of this segment starts
                for name, value in reply[RECURRENT_STATE].items():
                    self.first_state[name][:] = value
            # After a reset step (this step, if invalid) the env gives a new episode's first observation.
            self.next_step_starts = ~self.next_step_valid
        self._action = action
        if self.step_thread is not None:
            self.step_thread.start(action)

    def finish_step(self, t: int) -> None:
        """Step t's second half: the step's result (waited for, on a step thread) recorded."""
        clock = time.perf_counter()
        try:
            with self.watched_step:
                if self.step_thread is None:
                    obs, reward, terminated, truncated, info = self.envs.step(self._action)
                else:
                    (obs, reward, terminated, truncated, info), step_s = self.step_thread.wait()
        except UserError:  # the framework's own verdict on what the env gave (a text longer than its tokens)
            raise
        except Exception as exc:  # the env's own error (type, message, file:line) or its worker's death, not a stack
            step = self.steps_taken + 1
            what = worker_death(self.envs, exc, step) or f"raised at step {step}: {describe_exception(exc)}"
            raise UserCodeError(f"{self.describe}: env '{self.env_id}' {what}{old_gym_api_hint(exc)}") from exc
        # On a step thread the step's own time counts: this thread acted for another stage during most of it.
        self.env_s += time.perf_counter() - clock if self.step_thread is None else step_s
        self._action = None
        self.steps_taken += 1
        # NaN and inf survive a sum (overflow aside, which the exact check below then clears): one reduction per
        # array is the cheap common case of the check.
        if not (self.obs_is_float_array and math.isfinite(obs.sum() + reward.sum())):
            spaces.check_finite(self.describe, self.env_id, obs, reward, f"step {self.steps_taken}")

        self.rollout["terminated"][t] = terminated
        self.rollout["truncated"][t] = truncated
        if self.chunked:
            self._record_chunks(t, info)
        else:
            self.rollout["reward"][t] = reward
            self._record_episodes(t, info)
        if self.success is not None:
            at_any, at_end = self.success.step(info, self.rollout["valid"][t], terminated | truncated)
            self.rollout["episode_success"][t] = at_any
            self.rollout["episode_success_at_end"][t] = at_end
        if self.episodes:
            self._mask_inactive(t, terminated | truncated)
        self.obs = obs
        self.next_step_valid = ~(terminated | truncated)

    def _numpy_views(self, reply) -> dict:
        """numpy views of a reply's fields. A channel hands out the same few receive buffers again and again, so
        the views are made once per buffer: reading a TensorDict's fields costs ~5 us a step, the views ~1 us."""
        cached = self._reply_views.get(id(reply))
        if cached is None or cached[0] is not reply:
            cached = self._reply_views[id(reply)] = (reply, {key: value.numpy() for key, value in reply.items()})
        return cached[1]

    def _record_episodes(self, t: int, info: dict) -> None:
        episode = info.get("episode")
        if episode is None:
            # Zero the row's statistics too: the buffer is reused, and leftovers from an earlier rollout would reach
            # the experience log (and differ after a resume, whose buffer starts at zeros).
            self.rollout["episode_done"][t] = False
            self.rollout["episode_return"][t] = 0.0
            self.rollout["episode_length"][t] = 0
            return
        finished = info["_episode"]
        self.rollout["episode_done"][t] = finished
        self.rollout["episode_return"][t] = np.where(finished, episode["r"], 0.0)
        self.rollout["episode_length"][t] = np.where(finished, episode["l"], 0)

    def _start_episodes(self) -> None:
        """A rollout of whole episodes begins: every env resets, the envs of a group (env.group_size) with one seed,
        drawn from this rank's torch generator (seeded per rank, saved in checkpoints: a resume draws the same)."""
        base = self.episode_seed
        if base is None:
            base = draw_episode_seed(self.envs.num_envs)
        try:
            self.obs, _ = self.envs.reset(seed=group_seeds(base, self.envs.num_envs, self.group_size))
        except Exception as exc:  # the env's own reset: its error and file:line, not the vector env's stack
            raise UserCodeError(
                f"{self.describe}: env '{self.env_id}' raised in reset: {describe_exception(exc)}"
                f"{old_gym_api_hint(exc)}"
            ) from exc
        spaces.check_finite(self.describe, self.env_id, self.obs, None, "reset")
        check_group_starts(self.obs, self.group_size, self.env_id)
        self.active[:] = True
        self.next_step_valid[:] = True
        if self.recurrent:
            self.next_step_starts[:] = True
        if self.chunked:
            self.episode_primitive_steps[:] = 0

    def _mask_inactive(self, t: int, done: np.ndarray) -> None:
        """Steps of envs whose episode ended earlier in this rollout are no part of it: not valid, and no episode
        statistics (the vector env has autoreset them into episodes the rollout does not follow)."""
        active = self.rollout[ACTIVE][t]
        self.rollout["valid"][t] &= active
        if not active.all():
            self.rollout["episode_done"][t] &= active
            self.rollout["episode_return"][t] *= active
            self.rollout["episode_length"][t] *= active
            for key in SUCCESS_FIELDS.keys() & self.rollout.keys():
                self.rollout[key][t] &= active
        self.active &= ~done

    def _record_chunks(self, t: int, info: dict) -> None:
        """A decision's K rewards and which of its steps ran; then the episode statistics, lengths in primitive
        steps. An env on its reset step runs no step of its chunk (its info holds no chunk)."""
        rewards = info.get(CHUNK_REWARDS)
        if rewards is None:  # every env reset this step
            self.rollout["reward"][t] = 0.0
            self.rollout[CHUNK_VALID][t] = False
            self._record_episodes(t, info)
            return
        executed = executed_steps(info, self.envs.num_envs)
        self.rollout["reward"][t] = rewards  # zero where an env reset (gymnasium fills absent entries with 0)
        self.rollout[CHUNK_VALID][t] = self.chunk_steps < executed[:, None]
        self.episode_primitive_steps += executed
        self._record_episodes(t, info)
        finished = self.rollout["episode_done"][t]
        self.rollout["episode_length"][t] = np.where(finished, self.episode_primitive_steps, 0)
        self.episode_primitive_steps[finished] = 0

    def send_segment(self) -> None:
        send_segment(self.to_trainer, [self])

    def collect_segment(self, index: int) -> None:
        """One rollout acting on the inference server's replies (an env rank of the split layout), then the
        segment to the trainer. `index` is the rollout's number (the iteration), which async observations carry."""
        self.mark_segment(index)
        for t in range(self.num_steps):
            self.send_observations(t)
            self.receive_actions_and_step(t)
        self.send_segment()

    def collect_segment_in_process(self, index: int, serve_stage: Callable[[int], None]) -> None:
        """One rollout where the inference server runs in this process (the colocated layout): per step the
        observations, `serve_stage(0)` (the server's forward pass for them), the actions and the step; then the
        segment to the trainer."""
        self.mark_segment(index)
        for t in range(self.num_steps):
            self.send_observations(t)
            serve_stage(0)
            self.receive_actions_and_step(t)
        self.send_segment()

    def mark_segment(self, index: int) -> None:
        """Async observations carry the index of the rollout they belong to."""
        if self.segment_index is not None:
            self.to_inference.wait()  # the last observations of the previous rollout are out of the buffer
            self.segment_index[0] = index

    def state_dict(self) -> dict:
        """What a checkpoint holds of this runner: its envs' own state (None where it cannot be saved) and its
        place between rollouts."""
        env_state = self.env_backend.capture_state(self.envs) if self.env_backend is not None else None
        return {"env": env_state, "worker": self._place()}

    def load_state_dict(self, state: dict) -> None:
        # Envs whose state cannot be saved begin fresh episodes (said at start); the rest continue exactly.
        if state["env"] is not None:
            assert self.env_backend is not None  # only a backend captures env state (state_dict)
            self.env_backend.restore_state(self.envs, state["env"])
            self._load_place(state["worker"])

    def _place(self) -> dict:
        """Where the envs stand between rollouts (with their own state, see envs/gymnasium_state.py): the observation
        the next step acts on, which envs' next step is a reset, the step counter."""
        state = {
            "obs": as_tensors(self.obs),
            "next_step_valid": torch.from_numpy(self.next_step_valid.copy()),
            "steps_taken": self.steps_taken,
        }
        if self.recurrent:
            state["next_step_starts"] = torch.from_numpy(self.next_step_starts.copy())
        if self.success is not None:
            state["success_seen"] = torch.from_numpy(self.success.seen.copy())
        if self.chunked:
            state["episode_primitive_steps"] = torch.from_numpy(self.episode_primitive_steps.copy())
        return state

    def _load_place(self, state: dict) -> None:
        self.obs = as_arrays(state["obs"])
        self.next_step_valid = state["next_step_valid"].numpy().copy()
        self.steps_taken = state["steps_taken"]
        if self.recurrent:
            self.next_step_starts = state["next_step_starts"].numpy().copy()
        if self.success is not None:
            self.success.seen = state["success_seen"].numpy().copy()
        if self.chunked:
            self.episode_primitive_steps = state["episode_primitive_steps"].numpy().copy()

    def close(self) -> None:
        if self.step_thread is not None:
            with self.watched_step:  # a step still in flight (the run is ending on an error) finishes first
                self.step_thread.stop()
        close_envs(self.envs, abandoned=self._action is not None)  # a step begun, never finished: ending on its error


def draw_episode_seed(num_envs: int) -> int:
    """The first seed of a rollout of whole episodes for an env rank's `num_envs` envs, from this rank's torch
    generator (seeded per rank, saved in checkpoints: a resume draws the same)."""
    return int(torch.randint(2**31 - 1 - num_envs, ()))


def send_segment(to_trainer, runners: list[EnvRunner]) -> None:
    """The segment to the trainer: its runners' (a pipeline's stages') last observations and their summed timings."""
    for runner in runners:
        spaces.write(runner.next_obs_out, runner.obs)
    segment = to_trainer.buffer
    segment["env_s"].fill_(sum(runner.env_s for runner in runners))
    segment["action_wait_s"].fill_(sum(runner.action_wait_s for runner in runners))
    segment["inference_s"].fill_(sum(runner.inference_s for runner in runners))
    segment["inference_idle_s"].fill_(sum(runner.inference_idle_s for runner in runners))
    segment["rollout_s"].fill_(time.perf_counter() - runners[0].rollout_clock)
    to_trainer.send()
    for runner in runners:
        runner._reset_timers()


def _columns_of(views, columns: slice | None, axis: int):
    """The numpy views (nested dicts for Dict spaces) of a pipeline stage's envs: `columns` along `axis`."""
    if columns is None:
        return views
    if isinstance(views, dict):
        return {key: _columns_of(value, columns, axis) for key, value in views.items()}
    return views[(slice(None),) * axis + (columns,)]
