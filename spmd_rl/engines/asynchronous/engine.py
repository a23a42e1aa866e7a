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

Rules that keep it deadlock-free (the async form of the rules every engine keeps):
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

import time
from collections import deque

from spmd_rl.comm.channel import RecvHandle
from spmd_rl.engines.asynchronous.config import AsyncEngineConfig
from spmd_rl.engines.asynchronous.serving_threads import AsyncInferenceServer
from spmd_rl.engines.sync import SegmentSource, SyncEngine
from spmd_rl.interfaces.policy import Policy
from spmd_rl.persist import rank_state
from spmd_rl.roles.messages import async_observation_message
from spmd_rl.roles.trainer import Trainer, combine_segments
from spmd_rl.run.run import Run
from spmd_rl.runtime.errors import UserError


class AsyncPlan:
    """What the async engine adds to the plan: the lag bound and where all ranks agree; the same on every rank."""

    def __init__(self, run: Run):
        cfg, plan = run.cfg, run.plan
        self.plan = plan
        self.lag_bound = lag_bound(cfg, run.algorithm_cls.schedule(cfg.algo))
        self.every = cfg.checkpoint.every_iterations or cfg.engine.agree_every
        self.stop_after = cfg.run.stop_after_iterations
        # Segment receives a trainer keeps posted per env rank: a second lets an env rank run one segment ahead.
        self.depth = 2 if self.lag_bound > 0 else 1

    def agrees_after(self, iteration: int) -> bool:
        return (
            iteration == self.plan.num_iterations - 1
            or (iteration + 1) % self.every == 0
            or (self.stop_after > 0 and iteration + 1 == self.stop_after)
        )


def lag_bound(cfg, schedule) -> int:
    """The user's engine.max_policy_lag, or when unset the lag the algorithm's schedule tolerates."""
    asked = cfg.engine.max_policy_lag
    return schedule.max_policy_lag if asked is None else asked


class AsyncEngine(SyncEngine):
    """Env, inference and trainer ranks each run at their own pace, within engine.max_policy_lag (split layout).

    The sync engine's loops and hooks, with its own points where they differ: agreements at the agreed
    iterations, observations that carry their segment index, segments received as they arrive (the lag of every
    step checked), and an inference rank that serves whoever is ready (AsyncInferenceServer)."""

    Config = AsyncEngineConfig
    observation_layout = staticmethod(async_observation_message)

    @classmethod
    def check_plan(cls, cfg, topology, plan, schedule) -> None:
        """Before any process group: the layout and the lag the algorithm tolerates."""
        if schedule.rollout_unit == "none":
            raise UserError(
                f"engine.class=async overlaps rollouts with learning, and algo.class '{cfg.classes['algo']}' rolls "
                f"out nothing; use engine.class=sync"
            )
        if topology.colocated:
            raise UserError(
                "engine.class=async runs in the split layout only (env, inference and trainer ranks of "
                "their own); set layout.mode=split with layout.trainer/inference/env, or use "
                "engine.class=sync"
            )
        asked = cfg.engine.max_policy_lag
        if asked is not None and asked > schedule.max_policy_lag:  # what the algorithm could change: its check_plan
            raise UserError(
                f"engine.max_policy_lag={asked} is more than algo.class '{cfg.classes['algo']}' declares "
                f"it tolerates ({schedule.max_policy_lag}); lower engine.max_policy_lag"
            )

    @classmethod
    def asked_policy_lag(cls, config: AsyncEngineConfig) -> int | None:
        return config.max_policy_lag

    def run(self, run: Run) -> Policy | None:
        self.async_plan = AsyncPlan(run)
        self.segment_buffers = self.async_plan.depth
        if run.rank == 0:
            print(
                f"spmd_rl: async engine, max policy lag {self.async_plan.lag_bound}; all ranks agree (stops, "
                f"checkpoints) every {self.async_plan.every} iteration(s)",
                flush=True,
            )
        return super().run(run)

    def agrees_after(self, run: Run, iteration: int) -> bool:
        return self.async_plan.agrees_after(iteration)

    def inference_loop(self, run: Run, logger: None = None) -> None:
        """Threads serve whoever is ready within the lag bound (AsyncInferenceServer); this thread only joins the
        agreements, once everything before them is served and taken (rule 4)."""
        parts = run.inference_parts(async_observation_message, recv_buffers=2)
        server = AsyncInferenceServer(
            parts,
            run.plan,
            self.async_plan.lag_bound,
            run.iterations,
            run.runtime.device,
            run.runtime.timeout,
            run.cfg.weights.verify_every,
            run.describe,
            run.rank,
        )
        components = self.restored(run, {rank_state.INFERENCE_SERVER: server})  # the weights come from trainer 0
        server.start()
        # The last iteration ends with an agreement, so after the last one everything is served and taken.
        for iteration in run.iterations:
            if self.agrees_after(run, iteration):
                server.wait_served_through(iteration)
                run.end_iteration(iteration, components)
        server.finish()

    def segment_source(self, run: Run, trainer: Trainer) -> SegmentSource:
        """One segment per env rank per iteration, as they arrive, the lag of every step checked; the next
        segments' receives stay posted while learning (rule 5)."""
        plan, iterations, depth = run.plan, run.iterations, self.async_plan.depth
        posted: list[deque[RecvHandle]] = [deque() for _ in trainer.segment_channels]

        def post(iteration: int) -> None:
            if iteration < iterations.stop:
                for channel, handles in zip(trainer.segment_channels, posted):
                    handles.append(channel.irecv())

        for iteration in range(iterations.start, min(iterations.start + depth, iterations.stop)):
            post(iteration)

        def receive(iteration: int):
            clock = time.perf_counter()
            segments = [handles.popleft().wait() for handles in posted]
            wait_s = time.perf_counter() - clock
            lag = trainer.check_policy_lag(segments, plan.version_at(iteration), self.async_plan.lag_bound, iteration)
            segment = combine_segments(segments, copy=True)  # a copy: the buffers take the next receives
            post(iteration + depth)
            return segment, {**lag, "time_segment_wait_s": wait_s}

        return receive
