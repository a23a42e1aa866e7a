"""The async engine's inference server, run by threads (AsyncInferenceServer): it answers whichever of its env
ranks have sent, within the policy-lag bound, and takes new weights through a staging copy swapped in between
forward passes. The rules that keep this deadlock-free are in engine.py's docstring (this folder); this file holds
the lag gate they rely on."""

from __future__ import annotations

import datetime
import threading
import time

import torch
from tensordict import TensorDict

from spmd_rl.comm.staged_weights import StagedWeights
from spmd_rl.envs import spaces
from spmd_rl.interfaces.policy import EPISODE_START
from spmd_rl.roles.acting import act_for_replies, write_reply
from spmd_rl.roles.inference_server import InferenceParts, ServerState
from spmd_rl.runtime.errors import CommError


class AsyncInferenceServer(ServerState):
    """Serves its env ranks from the threads that receive their observations. One thread per env rank waits for
    that rank's next observation (gloo reports a receive's completion only through wait()) and, once it has one,
    serves every env rank ready then, in one forward pass, unless another thread is serving already, which then
    serves it too before it lets go (`serving`: one server at a time, so forward passes, weight swaps and replies
    never overlap). A thread per staged broadcast does the same once the broadcast is complete. An observation so
    costs one thread wake-up, as in the sync engine; the main thread only takes part in the agreements (where
    its state, ServerState's, is taken: every env rank is served exactly through the agreed iteration then)."""

    def __init__(
        self,
        parts: InferenceParts,
        plan,
        lag_bound: int,
        iterations: range,
        device: torch.device,
        timeout: datetime.timedelta,
        verify_every: int,
        describe_rank,
        rank: int,
    ):
        self.plan, self.lag_bound = plan, lag_bound
        self.policy, self.weight_sync = parts.policy, parts.weight_sync
        self.staged = StagedWeights(parts.weight_sync)
        self.device, self.timeout = device, timeout
        self.describe = describe_rank(rank)
        self.source = describe_rank(parts.weight_sync.src)
        self.env_names = parts.client_names  # its env ranks, each pipeline stage of one a client of its own
        per_stage = len(parts.obs_channels) // parts.stages
        self.stage_clients = [list(range(s * per_stage, (s + 1) * per_stage)) for s in range(parts.stages)]
        self.obs_channels, self.action_channels = parts.obs_channels, parts.action_channels
        self.output_keys = list(parts.policy.outputs())
        self.fields = dict(parts.policy.outputs())
        self.uniform_actions = parts.uniform_actions
        self.replies = [spaces.numpy_views(ch.buffer) for ch in self.action_channels]
        self.states = parts.states  # a recurrent policy's state per env (None: stateless)
        self.verify_every = verify_every
        self.lockstep = lag_bound == 0
        self.num_steps = plan.num_steps
        self.end_step = iterations.stop * self.num_steps
        self.next_step = [iterations.start * self.num_steps] * len(self.env_names)  # per client: its next step
        # Broadcasts after each iteration, in order; served_through(i) needs those up to i taken.
        self.syncs = [i for i in iterations if plan.syncs_after(i)]
        self.taken = 0
        self.policy_version = -1
        # Guarded by `lock` (the main thread waits on it): observations received and not yet served, whether a
        # thread is serving, whether the staged broadcast is complete, the first error of any thread.
        self.lock = threading.Condition()
        self.ready: dict[int, TensorDict] = {}
        self.serving = False
        self.weights_complete = False
        self.failure: BaseException | None = None
        self.progress_at = time.monotonic()
        self.pass_end = time.perf_counter()  # when the last forward pass ended: the idle time before the next

    # -- weights --------------------------------------------------------------------------------------------------

    def _post_next_broadcast(self) -> None:
        if self.taken < len(self.syncs):
            self.staged.post()
            threading.Thread(
                target=self._await_weights, daemon=True, name=f"spmd_rl-weights-{self.staged.posted}"
            ).start()

    def _await_weights(self) -> None:
        """A thread: once the posted broadcast is complete (a bounded wait), serve: that swaps it in when allowed."""
        self._enter_serving_thread()
        try:
            self.staged.wait()
            with self.lock:
                self.weights_complete = True
            self._serve_while_possible()
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread, which raises it
            self._fail(exc)

    def _take_weights(self) -> None:
        """Swap the staged broadcast in (between forward passes), verify when due, post the next one."""
        version = self.staged.swap()
        if self.verify_every and version % self.verify_every == 0:
            self.weight_sync.verify(version)
        with self.lock:
            self.policy_version = version
            self.taken += 1
            self.weights_complete = False
        self._post_next_broadcast()

    def _may_take(self, version: int) -> bool:
        """Whether every env rank still acting may use this version: none may act for a segment j with a version
        newer than version_at(j). (Trainer 0 may publish before a trainer of another env rank has that rank's
        segment, e.g. an update with no collective in it, like SAC's random warm-up.)"""
        return all(
            version <= self.plan.version_at(step // self.num_steps) for step in self.next_step if step < self.end_step
        )

    # -- observations ---------------------------------------------------------------------------------------------

    def _start_receivers(self) -> None:
        for index in range(len(self.obs_channels)):
            threading.Thread(
                target=self._receive,
                args=(index, self.end_step - self.next_step[index]),
                daemon=True,
                name=f"spmd_rl-obs-{self.env_names[index]}",
            ).start()

    def _receive(self, index: int, count: int) -> None:
        """A thread: receive env rank `index`'s observations and serve. Its receive of the next observation is
        posted as soon as one arrives (so the env rank's next send finds it posted), into the channel's other
        buffer, which held the observation before: that one was served before the env rank could send this."""
        self._enter_serving_thread()
        channel = self.obs_channels[index]
        try:
            pending = channel.irecv() if count else None
            for number in range(count):
                assert pending is not None  # posted above (count > 0) or at the end of the previous step
                message = pending.wait()
                if number + 1 < count:
                    pending = channel.irecv()
                with self.lock:
                    self._check_segment(index, message)
                    self.ready[index] = message
                self._serve_while_possible()
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread, which raises it
            self._fail(exc)

    def _serve_while_possible(self) -> None:
        """Become the server unless a thread is serving already (it then sees what this thread added): swap in a
        complete broadcast when allowed, act for every env rank the weights allow, until nothing is left to do."""
        with self.lock:
            if self.serving or self.failure is not None:
                return
            self.serving = True
        try:
            while True:
                with self.lock:
                    take = self.weights_complete and self._may_take(self.staged.version())
                    serve = [] if take else self._servable()
                    if not (take or serve):
                        self.serving = False
                        self.lock.notify_all()  # the main thread may have reached an agreement
                        return
                    messages = [self.ready.pop(index) for index in serve]
                if take:
                    self._take_weights()
                else:
                    self._serve(serve, messages)
                self.progress_at = time.monotonic()
        except BaseException:
            with self.lock:
                self.serving = False
            raise

    def _enter_serving_thread(self) -> None:
        """What a thread that may act sets for itself (both are per thread): no autograd, this rank's GPU."""
        torch.set_grad_enabled(False)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    def _fail(self, exc: BaseException) -> None:
        with self.lock:
            if self.failure is None:
                self.failure = exc
            self.lock.notify_all()

    def _check_segment(self, index: int, message: TensorDict) -> None:
        expected = self.next_step[index] // self.num_steps
        got = int(message["segment"][0])
        if got != expected:
            raise CommError(
                f"{self.describe}: observations from {self.env_names[index]} are of segment {got}, "
                f"expected segment {expected} (step {self.next_step[index]}); the ranks' schedules "
                f"differ"
            )

    def _servable(self) -> list[int]:
        """The clients (env ranks, or their pipeline stages) to act for now, in the fixed order: with lag 0 one
        stage of every env rank or none (exactly the sync engine's batches, in its order), else every ready one
        whose segment the current weights may act for."""
        allowed = [
            index
            for index in sorted(self.ready)
            if self.policy_version >= self.required_version(self.next_step[index] // self.num_steps)
        ]
        if self.lockstep:  # the stage the sync engine serves next (the earliest step, then the lowest stage)
            due = min(self.stage_clients, key=lambda clients: self.next_step[clients[0]])
            return due if set(due) <= set(allowed) else []
        return allowed

    def _serve(self, serve: list[int], messages: list[TensorDict]) -> None:
        # Env ranks in one forward pass act alike: uniformly at random during warm-up, else with the policy.
        explores = [self.plan.explores_at(self.next_step[index] // self.num_steps) for index in serve]
        for flag in sorted(set(explores)):
            group = [(index, message) for index, message, explore in zip(serve, messages, explores) if explore == flag]
            observations = [message["obs"] for _, message in group]
            obs = observations[0] if len(observations) == 1 else torch.cat(observations)
            served = [index for index, _ in group]
            recurrent = self.states is not None and not flag
            if recurrent:  # the replies get their recurrent state before their sends below: previous sends are out
                for index in served:
                    self.action_channels[index].wait()
            idle_s = time.perf_counter() - self.pass_end
            outputs, inference_s = act_for_replies(
                self.policy,
                obs,
                self.device,
                self.fields,
                self.uniform_actions if flag else None,
                self.states,
                served,
                [message[EPISODE_START] for _, message in group] if recurrent else (),
                [self.replies[index] for index in served] if recurrent else (),
            )
            offset = 0
            for index in served:
                channel = self.action_channels[index]
                channel.wait()  # the previous reply to this env rank is out of the buffer
                offset = write_reply(
                    self.replies[index], self.output_keys, outputs, offset, self.policy_version, inference_s, idle_s
                )
                # Counted before the send: the env rank's next observation can arrive (and be checked against
                # next_step by its receiving thread) the moment the reply is out.
                with self.lock:
                    self.next_step[index] += 1
                channel.isend()
            self.pass_end = time.perf_counter()

    # -- the main thread: agreements, the end ---------------------------------------------------------------------

    def start(self) -> None:
        """Take the initial weights (trainer 0's), then serve from threads until every step is served."""
        self.policy_version = self.weight_sync.broadcast(self.policy_version)
        self._post_next_broadcast()
        self._start_receivers()

    def wait_served_through(self, iteration: int) -> None:
        """The main thread: block until every env rank is served through segment `iteration` and every
        broadcast made by then is taken (the point where this rank may join the end-of-iteration agreement)."""
        self._wait_until(lambda: self._served_through(iteration), f"the end of iteration {iteration}")

    def finish(self) -> None:
        """After the last iteration's agreement: the last replies are out of their buffers."""
        for channel in self.action_channels:
            channel.wait()

    def required_version(self, segment: int) -> int:
        """The oldest version that may act for an env rank's segment."""
        return self.plan.version_at(segment) - self.lag_bound

    def _served_through(self, iteration: int) -> bool:
        """Every env rank served through segment `iteration` and every broadcast made by then taken (rule 4)."""
        end = (iteration + 1) * self.num_steps
        due = sum(1 for i in self.syncs if i <= iteration)
        return all(step >= end for step in self.next_step) and self.taken >= due and not self.serving

    def _wait_until(self, done, what: str) -> None:
        """The main thread waits for the serving threads to reach a point; a thread's error is raised here. Every
        thread's own waits are bounded; this one is a backstop, counted from the last progress."""
        limit = self.timeout.total_seconds() + 5.0
        with self.lock:
            while not done():
                if self.failure is not None:
                    raise self.failure
                if time.monotonic() - self.progress_at > limit:
                    raise self._stuck(what)
                self.lock.wait(timeout=1.0)
            if self.failure is not None:
                raise self.failure

    def _stuck(self, what: str) -> CommError:
        held = [self.env_names[index] for index in sorted(self.ready)]
        silent = [
            self.env_names[index]
            for index in range(len(self.obs_channels))
            if index not in self.ready and self.next_step[index] < self.end_step
        ]
        needed = min(
            (self.required_version(self.next_step[index] // self.num_steps) for index in self.ready),
            default=self.policy_version + 1,
        )
        return CommError(
            f"{self.describe}: waited {self.timeout.total_seconds():g}s for {what}: holding "
            f"observations of {held or 'no env rank'} for weights version {needed} (holding "
            f"{self.policy_version}) from {self.source}; no observations from {silent or 'no env rank'}"
        )
