"""The async engine (`engine.class: async`, split layout): env ranks keep stepping, an inference rank answers
whichever of its env ranks have sent, trainers learn from segments as they arrive, and trainer 0 broadcasts new
weights after every update, which inference ranks take into a staging copy and swap in between forward passes.

Policy lag. Segment j of an env rank (its j-th rollout, one per iteration) may at best act with version
`version_at(j)` (the version the sync engine uses for iteration j). A step acting with version v lags by
`version_at(j) - v`. An inference rank acts for an env rank's segment j only once it holds a version
>= version_at(j) - max_policy_lag, and it swaps a newer version in only once none of its env ranks still acts for
a segment that version is too new for (trainer 0 may publish version j+1 before another trainer has an env rank's
segment j, when an update has no collective in it, like SAC's random warm-up). So with max_policy_lag=0 every step
uses exactly the sync engine's weights, and the trainer checks every step it receives against the bound
(metrics policy_lag_mean / policy_lag_max).

Exactness at lag 0. Sampling an action draws random numbers for the whole batch of a forward pass, so which env
ranks share a batch decides which numbers each env gets. With max_policy_lag=0 the lag bound already makes the env
ranks of an inference rank advance together, so the inference rank serves them in lockstep, in the fixed order,
one forward pass per step (as the sync engine does): the async engine then gives exactly the sync engine's
metrics and weights, and the sync engine is unchanged. With a lag > 0 it batches whoever is ready.

Rules that keep it deadlock-free (the async form of DESIGN.md's rules):
1. Counts follow from the config alone. Per iteration, an env rank sends num_steps observations to its inference
   rank (each carrying its segment index j, which the inference rank checks against its own count), receives as
   many replies, and sends one segment to its trainer; the trainer receives one segment per env rank; the weight
   group makes one broadcast per synced iteration plus the initial one, in iteration order, and a verify after
   the versions the config names. Only the ORDER in which an inference rank serves different env ranks depends
   on data, and each env rank has channels of its own (own peer, own tags), so no message can match another's.
2. Every collective is at a point every member can compute: the k-th broadcast of the weight group is version
   `k`-th in the schedule on every member; receivers post it (async_op) into a staging copy as soon as the
   (k-1)-th is taken, so the source never waits long; the world's end-of-iteration agreement (stops, checkpoints)
   happens after iterations every rank computes alike (`agrees_after`).
3. The slowest env rank can always be served: it needs a version at most version_at(j_min), and that version
   needs only segments before j_min, which every env rank has sent; the weights it holds are never too new for
   it (they are swapped in only when no env rank is behind them). An inference rank keeps serving every env rank
   the lag allows while it waits for weights, so it never blocks a segment a trainer needs. A staged broadcast
   held back (an env rank still behind it) delays trainer 0's next broadcast; the env rank behind it is one
   whose trainer has not yet learned that segment, and that trainer's progress never waits for the broadcast
   (trainers meet only in their own group, once per iteration, which also keeps them within one iteration).
4. Before an agreement after iteration c, every rank has done all of its part of iterations <= c: env ranks sent
   segment c; trainers learned it and trainer 0 broadcast the next version; inference ranks served segment c of
   all their env ranks and took every broadcast up to that version. No rank waits in the agreement for a rank
   that would first have to pass it. Receives posted ahead (the next observations, the next segments) stay
   posted across it.
5. Trainers keep the next segment's receive posted (two buffers per env rank when the lag is > 0), so an env
   rank's segment send completes without waiting for learning.
6. Every wait is bounded by dist.timeout_s and names who waited for whom: channels and collectives as in the sync
   engine; an inference rank's wait for weights names trainer 0 and the env ranks held back.
"""

from __future__ import annotations

import threading
import time
from collections import deque

import torch
from tensordict import TensorDict

from spmd_rl.api import Engine, Policy
from spmd_rl.async_config import AsyncEngineConfig
from spmd_rl.comm.channel import open_channels
from spmd_rl.comm.staged_weights import StagedWeights
from spmd_rl.engine import (Reporter, Setup, _build_algorithm, _env_state, _init_from, _restore_trainer, _seed_rank,
                            _trainer_state, _uniform_actions, _weight_sync, build_env_worker, build_policy,
                            make_experience_log, run_with_metrics)
from spmd_rl.checkpoint import restore_rng_state
from spmd_rl.errors import CommError, UserError
from spmd_rl.metrics import MetricsLogger
from spmd_rl.roles.messages import action_message, observation_message, segment_message
from spmd_rl.roles.trainer import Trainer
from spmd_rl.topology import ENV, INFERENCE


class PolicyLagError(RuntimeError):
    """A step acted with weights older than engine.max_policy_lag allows (an engine bug, never a user's)."""


def async_observation_message(spec, num_envs: int) -> TensorDict:
    """env worker -> inference server in async mode: the observations and the env rank's segment index."""
    message = observation_message(spec, num_envs)
    message["segment"] = torch.zeros(1, dtype=torch.int64)
    return message


class AsyncSchedule:
    """What the async engine adds to the plan: the lag bound and where all ranks agree; the same on every rank."""

    def __init__(self, setup: Setup):
        cfg, plan = setup.cfg, setup.plan
        self.plan = plan
        self.lag = effective_lag(cfg, setup.algorithm_cls.schedule(cfg.algo))
        self.every = cfg.checkpoint.every_iterations or cfg.engine.agree_every
        self.stop_after = cfg.run.stop_after_iterations
        # Segment receives a trainer keeps posted per env rank: a second lets an env rank run one segment ahead.
        self.depth = 2 if self.lag > 0 else 1

    def required_version(self, segment: int) -> int:
        return self.plan.version_at(segment) - self.lag

    def agrees_after(self, iteration: int) -> bool:
        return (iteration == self.plan.num_iterations - 1 or (iteration + 1) % self.every == 0
                or (self.stop_after > 0 and iteration + 1 == self.stop_after))


def effective_lag(cfg, schedule) -> int:
    asked = cfg.engine.max_policy_lag
    return schedule.max_policy_lag if asked is None else asked


class AsyncEngine(Engine):
    """Env, inference and trainer ranks each run at their own pace, within engine.max_policy_lag (split layout)."""

    Config = AsyncEngineConfig

    @classmethod
    def check_plan(cls, cfg, topology, plan, schedule) -> None:
        """Before any process group: the layout and the lag the algorithm tolerates."""
        if topology.colocated:
            raise UserError("engine.class=async runs in the split layout only (env, inference and trainer ranks of "
                            "their own); set layout.mode=split with layout.trainer/inference/env, or use "
                            "engine.class=sync")
        asked = cfg.engine.max_policy_lag
        if asked is not None and asked > schedule.max_policy_lag:
            raise UserError(f"engine.max_policy_lag={asked} is more than algo.class '{cfg.classes['algo']}' declares "
                            f"it tolerates ({schedule.max_policy_lag}); lower engine.max_policy_lag"
                            + (" or set algo.vtrace=true (PPO's off-policy correction)"
                               if hasattr(cfg.algo, "vtrace") and not cfg.algo.vtrace else ""))

    def run(self, setup: Setup) -> Policy | None:
        rank = setup.runtime.rank
        schedule = AsyncSchedule(setup)
        if rank == 0:
            print(f"spmd_rl: async engine, max policy lag {schedule.lag}; all ranks agree (stops, checkpoints) "
                  f"every {schedule.every} iteration(s)", flush=True)

        def run_role(logger: MetricsLogger | None) -> None:
            role = setup.topology.role_of(rank)
            if role == ENV:
                _run_env(setup, schedule)
            elif role == INFERENCE:
                _run_inference(setup, schedule)
            else:
                _run_trainer(setup, schedule, logger)

        return run_with_metrics(setup, run_role)


# ---------------------------------------------------------------------------------------------------------------
# Env ranks: the sync story, with the segment index on every observation and agreements at the agreed iterations


def _run_env(setup: Setup, schedule: AsyncSchedule) -> None:
    worker = build_env_worker(setup, async_observation_message)
    segment_index = worker.to_inference.buffer["segment"].numpy()
    t = setup.plan.num_steps
    try:
        for iteration in setup.iterations:
            segment_index[0] = iteration  # observations are sent whole, so the previous send is complete here
            for step in range(t):
                worker.send_observations(step)
                worker.receive_actions_and_step(step)
            worker.send_segment()
            if schedule.agrees_after(iteration):
                setup.control.after_iteration(iteration, lambda: _env_state(worker))
    finally:
        worker.close()


# ---------------------------------------------------------------------------------------------------------------
# Inference ranks: answer whoever is ready and within the lag bound; weights through a staging copy


class AsyncInferenceServer:
    """Serves its env ranks from the threads that receive their observations. One thread per env rank waits for
    that rank's next observation (gloo reports a receive's completion only through wait()) and, once it has one,
    serves every env rank ready then, in one forward pass, unless another thread is serving already, which then
    serves it too before it lets go (`serving`: one server at a time, so forward passes, weight swaps and replies
    never overlap). A thread per staged broadcast does the same once the broadcast is complete. An observation so
    costs one thread wake-up, as in the sync engine; the main thread only takes part in the agreements."""

    def __init__(self, setup: Setup, schedule: AsyncSchedule, policy: Policy, weight_sync, served: tuple[int, ...],
                 obs_channels: list, action_channels: list):
        self.setup, self.schedule, self.plan = setup, schedule, setup.plan
        self.policy, self.weight_sync = policy, weight_sync
        self.staged = StagedWeights(weight_sync)
        self.device, self.timeout = setup.runtime.device, setup.runtime.timeout
        self.describe = setup.topology.describe(setup.runtime.rank)
        self.env_names = [setup.topology.describe(env) for env in served]
        self.obs_channels, self.action_channels = obs_channels, action_channels
        self.output_keys = list(policy.outputs())
        self.uniform_actions = _uniform_actions(setup)
        self.replies = [{key: tensor.numpy() for key, tensor in ch.buffer.items()} for ch in action_channels]
        self.verify_every = setup.cfg.weights.verify_every
        self.lockstep = schedule.lag == 0
        iterations = setup.iterations
        self.num_steps = self.plan.num_steps
        self.end_step = iterations.stop * self.num_steps
        self.next_step = [iterations.start * self.num_steps] * len(served)   # per env rank: the next step to serve
        # Broadcasts after each iteration, in order; the agreement after iteration i needs those up to i taken.
        self.syncs = [i for i in iterations if self.plan.syncs_after(i)]
        self.agreements = deque(i for i in iterations if schedule.agrees_after(i))
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

    # -- weights --------------------------------------------------------------------------------------------------

    def receive_initial_weights(self) -> None:
        self.policy_version = self.weight_sync.broadcast(self.policy_version)
        self._post_next_broadcast()

    def _post_next_broadcast(self) -> None:
        if self.taken < len(self.syncs):
            self.staged.post()
            threading.Thread(target=self._await_weights, daemon=True,
                             name=f"spmd_rl-weights-{self.staged.posted}").start()

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
        return all(version <= self.plan.version_at(step // self.num_steps)
                   for step in self.next_step if step < self.end_step)

    # -- observations ---------------------------------------------------------------------------------------------

    def _start_receivers(self) -> None:
        for index in range(len(self.obs_channels)):
            threading.Thread(target=self._receive, args=(index, self.end_step - self.next_step[index]), daemon=True,
                             name=f"spmd_rl-obs-{self.env_names[index]}").start()

    def _receive(self, index: int, count: int) -> None:
        """A thread: receive env rank `index`'s observations and serve. Its receive of the next observation is
        posted as soon as one arrives (so the env rank's next send finds it posted), into the channel's other
        buffer, which held the observation before: that one was served before the env rank could send this."""
        self._enter_serving_thread()
        channel = self.obs_channels[index]
        try:
            pending = channel.irecv() if count else None
            for number in range(count):
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
            raise CommError(f"{self.describe}: observations from {self.env_names[index]} are of segment {got}, "
                            f"expected segment {expected} (step {self.next_step[index]}); the ranks' schedules "
                            f"differ")

    def _servable(self) -> list[int]:
        """The env ranks to act for now, in the fixed order: with lag 0 all of them or none (exactly the sync
        engine's batches), else every ready one whose segment the current weights may act for."""
        allowed = [index for index in sorted(self.ready)
                   if self.policy_version >= self.schedule.required_version(self.next_step[index] // self.num_steps)]
        if self.lockstep:
            return allowed if len(allowed) == len(self.obs_channels) else []
        return allowed

    def _serve(self, serve: list[int], messages: list[TensorDict]) -> None:
        # Env ranks in one forward pass act alike: uniformly at random during warm-up, else with the policy.
        explores = [self.plan.explores_at(self.next_step[index] // self.num_steps) for index in serve]
        for flag in sorted(set(explores)):
            group = [(index, message) for index, message, explore in zip(serve, messages, explores)
                     if explore == flag]
            observations = [message["obs"] for _, message in group]
            obs = observations[0] if len(observations) == 1 else torch.cat(observations)
            clock = time.perf_counter()
            if flag:
                out = self.uniform_actions(obs.shape[0])
            else:
                out = self.policy.act(obs.to(self.device, non_blocking=True))
            outputs = [out[key].cpu().numpy() for key in self.output_keys]
            inference_s = time.perf_counter() - clock
            offset = 0
            for index, _ in group:
                channel, reply = self.action_channels[index], self.replies[index]
                channel.wait()  # the previous reply to this env rank is out of the buffer
                count = reply["action"].shape[0]
                for key, value in zip(self.output_keys, outputs):
                    reply[key][:] = value[offset:offset + count]
                reply["policy_version"][0] = self.policy_version
                reply["inference_s"][0] = inference_s
                channel.isend()
                offset += count
                with self.lock:
                    self.next_step[index] += 1

    # -- the main thread: agreements, the end ---------------------------------------------------------------------

    def run(self) -> None:
        self._start_receivers()
        # The last iteration ends with an agreement, so after the last one everything is served and taken.
        while self.agreements:
            iteration = self.agreements.popleft()
            self._wait_until(lambda: self._served_through(iteration), f"the end of iteration {iteration}")
            self.setup.control.after_iteration(iteration, dict)  # the weights come from trainer 0
        for channel in self.action_channels:
            channel.wait()

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
        silent = [self.env_names[index] for index in range(len(self.obs_channels))
                  if index not in self.ready and self.next_step[index] < self.end_step]
        source = self.setup.topology.describe(self.weight_sync.src)
        needed = min((self.schedule.required_version(self.next_step[index] // self.num_steps)
                      for index in self.ready), default=self.policy_version + 1)
        return CommError(f"{self.describe}: waited {self.timeout.total_seconds():g}s for {what}: holding "
                         f"observations of {held or 'no env rank'} for weights version {needed} (holding "
                         f"{self.policy_version}) from {source}; no observations from {silent or 'no env rank'}")


def _run_inference(setup: Setup, schedule: AsyncSchedule) -> Policy:
    cfg, topology, runtime = setup.cfg, setup.topology, setup.runtime
    rank = runtime.rank
    served = topology.envs_served_by(rank)
    n = cfg.env.num_envs
    policy = build_policy(cfg, setup.spec, setup.policy_cls, runtime.device)
    weight_sync = _weight_sync(setup, policy)
    _seed_rank(cfg, rank)
    action_channels, obs_channels = open_channels(
        me=rank,
        sends=[(env, "actions", action_message(setup.outputs, n)) for env in served],
        recvs=[(env, "observations", async_observation_message(setup.spec, n)) for env in served],
        describe_rank=topology.describe, timeout=runtime.timeout, num_recv_buffers=2)
    server = AsyncInferenceServer(setup, schedule, policy, weight_sync, served, obs_channels, action_channels)
    state = setup.load_checkpoint()
    if state is not None:
        restore_rng_state(state["rng"])
    server.receive_initial_weights()
    server.run()
    return policy


# ---------------------------------------------------------------------------------------------------------------
# Trainer ranks: one segment per env rank per iteration, as they arrive; the lag of every step checked


def _run_trainer(setup: Setup, schedule: AsyncSchedule, logger) -> Policy:
    cfg, plan, topology, runtime = setup.cfg, setup.plan, setup.topology, setup.runtime
    rank = runtime.rank
    sources = topology.envs_trained_by(rank)
    n, t = cfg.env.num_envs, plan.num_steps
    group = setup.groups.trainer if len(topology.trainer_ranks) > 1 else None
    policy = build_policy(cfg, setup.spec, setup.policy_cls, runtime.device)
    weight_sync = _weight_sync(setup, policy) if rank == topology.trainer_ranks[0] else None
    algorithm, callbacks = _build_algorithm(setup, policy, group)
    _seed_rank(cfg, rank)
    _, segment_channels = open_channels(
        me=rank, sends=[],
        recvs=[(env, "segments", segment_message(setup.spec, setup.outputs, t, n)) for env in sources],
        describe_rank=topology.describe, timeout=runtime.timeout, num_recv_buffers=schedule.depth)
    names = [topology.describe(e) for e in sources]
    trainer = Trainer(algorithm, segment_channels, names, plan.max_env_columns_per_trainer * t, group, weight_sync,
                      make_experience_log(setup, rank), describe=topology.describe(rank), timeout=runtime.timeout,
                      skip_nonfinite_updates=cfg.train.skip_nonfinite_updates)
    state = setup.load_checkpoint()
    if state is None:
        _init_from(setup, policy, algorithm)
    else:
        _restore_trainer(state, policy, trainer, logger)
        restore_rng_state(state["rng"])
    if rank == 0:
        setup.final_policy = policy
    report = Reporter(setup, logger, callbacks, policy)
    iterations = setup.iterations

    def capture() -> dict:
        return _trainer_state(policy, trainer, logger)

    posted = [deque() for _ in segment_channels]

    def post(iteration: int) -> None:
        if iteration < iterations.stop:
            for channel, handles in zip(segment_channels, posted):
                handles.append(channel.irecv())

    try:
        trainer.publish_weights(plan.version_at(iterations.start), verify=False)
        for iteration in range(iterations.start, min(iterations.start + schedule.depth, iterations.stop)):
            post(iteration)
        for iteration in iterations:
            trainer.weight_sync_s = 0.0
            clock = time.perf_counter()
            segments = [handles.popleft().wait() for handles in posted]
            wait_s = time.perf_counter() - clock
            lag = _policy_lag(segments, names, plan.version_at(iteration), schedule.lag, trainer.describe, iteration)
            segment = _combine(segments)   # a copy: the buffers take the next receives
            post(iteration + schedule.depth)
            metrics = trainer.learn(segment, iteration)
            if plan.syncs_after(iteration):
                version = plan.version_at(iteration + 1)
                verify = bool(cfg.weights.verify_every) and version % cfg.weights.verify_every == 0
                trainer.publish_weights(version, verify=verify)
            metrics = {**metrics, **lag, "time_segment_wait_s": wait_s}
            report(iteration, metrics, trainer.gather_statistics(segment), trainer)
            if schedule.agrees_after(iteration):
                setup.control.after_iteration(iteration, capture)
    finally:
        trainer.close()
    return policy


def _policy_lag(segments: list, names: list[str], freshest: int, bound: int, describe: str,
                iteration: int) -> dict[str, float]:
    """Lag of every step this trainer received for an iteration (versions behind the freshest it could use)."""
    lags = torch.cat([freshest - segment["policy_version"] for segment in segments])
    worst = int(lags.max())
    if worst > bound or int(lags.min()) < 0:
        who = [name for name, segment in zip(names, segments)
               if bool(((freshest - segment["policy_version"]) > bound).any()
                       or (segment["policy_version"] > freshest).any())]
        raise PolicyLagError(f"{describe}: iteration {iteration}: segments from {who} acted with policy versions "
                             f"outside [{freshest - bound}, {freshest}] (max_policy_lag {bound})")
    return {"policy_lag_mean": float(lags.double().mean()), "policy_lag_max": float(worst)}


def _combine(segments: list) -> TensorDict:
    """The segments of all env ranks as one (env columns side by side), in the sync engine's layout; a copy."""
    if len(segments) == 1:
        return segments[0].clone()
    return TensorDict({
        "rollout": torch.cat([s["rollout"] for s in segments], dim=1),
        "next_obs": torch.cat([s["next_obs"] for s in segments]),
        "policy_version": segments[0]["policy_version"].clone(),
        "env_s": torch.cat([s["env_s"] for s in segments]),
        "action_wait_s": torch.cat([s["action_wait_s"] for s in segments]),
        "inference_s": torch.cat([s["inference_s"] for s in segments]),
    }, batch_size=[])
