"""The end of every iteration, on every rank: do we checkpoint now, and do we stop?

Every rank computes the same answer at the same iteration: periodic checkpoints follow from the config
(`checkpoint.every_iterations`, the last iteration, `run.stop_after_iterations`), and what only one rank can know
(a signal it received, rank 0's clock for `checkpoint.every_s`) travels in one tiny all_reduce over all ranks.
So every rank saves at the same iteration and no rank stops alone. A checkpoint is committed by rank 0 once every
rank reported its file written (a second all_reduce), so a kill at any moment leaves the previous one loadable.
At an agreement that may end the run (the last iteration; any, with run.stop_at_return) the same all_reduce also
gathers a few numbers of every rank (`rank_facts`: what finished.json's "ranks" records), each in its own slots.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from spmd_rl.comm.parallel_plan import shards
from spmd_rl.persist.checkpoint import CheckpointStore, capture_rng_state
from spmd_rl.persist.rank_state import ITERATION, RNG
from spmd_rl.runtime.distributed import bounded
from spmd_rl.runtime.errors import UserError
from spmd_rl.runtime.exits import under_plain_torchrun
from spmd_rl.runtime.orphans import gone_now
from spmd_rl.runtime.signals import past_the_last_boundary, requested_stop, signal_name, stop_cause


class StoppedWithCheckpoint(Exception):
    """Every rank agreed to stop after a signal; the checkpoint is committed. main prints one line, exit 75."""

    def __init__(self, signal_name: str, iteration: int, checkpoint: Path, planned: bool = False):
        # A signal's stop exits 75 (or the agent was signalled too): plain torchrun's agent then prints its FAILED
        # report or its SignalException traceback and exits 1. Say so here: no line of ours can follow the agent's.
        cause = stop_cause() or gone_now()
        agent = (
            "; plain torchrun reports the stop as a failure below and exits 1: it is checkpointed (launch/torchrun.sh"
            " exits 75 without that report)"
            if under_plain_torchrun() and not planned and not cause  # not when the agent is gone
            else ""
        )
        super().__init__(
            f"stopped by {signal_name}{cause} after iteration {iteration}; checkpoint {checkpoint}; rerun the "
            f"same command to resume{agent}"
        )
        self.checkpoint = checkpoint
        self.finished = False  # True: the run is done (run.stop_at_return), not waiting for a rerun
        self.planned = planned  # the config asked for it (run.stop_after_iterations), not a signal


class ReachedReturn(StoppedWithCheckpoint):
    """Every rank agreed that rank 0's mean return reached run.stop_at_return: the run is finished (exit 0)."""

    def __init__(self, threshold: float, mean_return: float, iteration: int, checkpoint: Path):
        Exception.__init__(
            self,
            f"reached run.stop_at_return={threshold:g} (mean return of the last episodes {mean_return:.2f}) after "
            f"iteration {iteration}; checkpoint {checkpoint}; the run is finished",
        )
        self.checkpoint, self.finished = checkpoint, True


class RunControl:
    def __init__(self, cfg, num_iterations: int, rank: int, world_size: int, distributed: bool, run_dir: Path, timeout):
        self.every_iterations = cfg.checkpoint.every_iterations
        self.every_s = cfg.checkpoint.every_s
        self.stop_after = cfg.run.stop_after_iterations
        self.stop_at_return = cfg.run.stop_at_return
        # rank 0: the headline return (the mean of the last episodes) after the iteration just logged
        self.mean_return: Callable[[], float] = lambda: float("nan")
        # this rank's numbers for the run's end record (a fixed count, the same on every rank), and every rank's as
        # gathered by the last agreement that could end the run (rank order)
        self.rank_facts: Callable[[], tuple[float, ...]] = lambda: ()
        self.gathered_facts: list[tuple[float, ...]] = []
        self.num_iterations = num_iterations
        self.rank, self.world_size, self.distributed = rank, world_size, distributed
        self.store = CheckpointStore(run_dir, keep=cfg.checkpoint.keep)
        self.sharded = shards(cfg.train.parallel)  # the trainers' save is then a collective of theirs (DCP)
        self.timeout = timeout
        self.last_checkpoint = time.monotonic()
        self.save_s = 0.0  # seconds this rank spent on its last checkpoint (0 when none this iteration)
        # rank 0, once every rank saved a checkpoint and before it is committed: what must be on disk when it counts
        self.before_commit: Callable[[], None] = lambda: None
        self.after_commit: Callable[[], None] = lambda: None  # rank 0, after every committed checkpoint

    def after_iteration(self, iteration: int, capture: Callable[[], dict]) -> None:
        """Checkpoint when due; raise StoppedWithCheckpoint when the ranks agreed to stop. capture() builds this
        rank's state (called only when a checkpoint is taken)."""
        self.save_s = 0.0
        last = iteration == self.num_iterations - 1
        stop_here = bool(self.stop_after) and iteration + 1 == self.stop_after and not last
        due = last or stop_here or (self.every_iterations > 0 and (iteration + 1) % self.every_iterations == 0)
        timed_out = self.every_s > 0 and time.monotonic() - self.last_checkpoint >= self.every_s
        if last:  # a signal from here on lets the run finish, and its line says so
            past_the_last_boundary()
        stop = requested_stop()
        mean_return = self.mean_return() if self.stop_at_return is not None and self.rank == 0 else float("nan")
        reached = mean_return >= self.stop_at_return if self.stop_at_return is not None else False  # NaN: not yet
        facts = self.rank_facts() if last or self.stop_at_return is not None else ()
        signal_number, timed_out, reached, mean_return = self._agree(
            stop[1] if stop else 0, timed_out, reached, mean_return, facts
        )
        if not (due or timed_out or signal_number or reached):
            return
        clock = time.perf_counter()
        directory = self._save(iteration, capture)
        self.save_s = time.perf_counter() - clock
        self.last_checkpoint = time.monotonic()
        if signal_number:
            raise StoppedWithCheckpoint(signal_name(signal_number), iteration, directory)
        if reached and not last:  # after the last iteration the run ends as planned
            raise ReachedReturn(self.stop_at_return, mean_return, iteration, directory)
        if stop_here:
            raise StoppedWithCheckpoint(
                f"run.stop_after_iterations={self.stop_after}", iteration, directory, planned=True
            )

    def wait_for_stop_files(self) -> None:
        """After a stop: no rank exits before rank 0 has committed the checkpoint and written policy.pt (a launcher
        that sees the first rank exit may kill the rest)."""
        if self.distributed:
            done = torch.ones(1, dtype=torch.int64)
            self._all_reduce(done, dist.ReduceOp.SUM, "stop: wait for rank 0's checkpoint and policy.pt")

    def _agree(
        self, signal_number: int, timed_out: bool, reached: bool, mean_return: float, facts: tuple[float, ...]
    ) -> tuple[int, bool, bool, float]:
        """(a signal any rank received, rank 0's clock says a timed checkpoint is due, rank 0's mean return reached
        run.stop_at_return, rank 0's mean return), the same on every rank; with `facts`, every rank's facts into
        gathered_facts. Small integers and the return travel exactly as float64."""
        if not self.distributed:
            if facts:
                self.gathered_facts = [facts]
            return signal_number, timed_out, reached, mean_return
        known = self.rank == 0 and mean_return == mean_return  # NaN (no episode yet) takes no part in MAX
        slots = [-math.inf] * (len(facts) * self.world_size)  # every rank's own slots; MAX leaves each its value
        slots[self.rank * len(facts) : (self.rank + 1) * len(facts)] = facts
        flags = torch.tensor(
            [
                signal_number,
                int(timed_out and self.rank == 0),
                int(reached and self.rank == 0),
                mean_return if known else -math.inf,
                *slots,
            ],
            dtype=torch.float64,
        )
        self._all_reduce(flags, dist.ReduceOp.MAX, "end-of-iteration agreement (checkpoint or stop) all_reduce")
        if facts:
            gathered = flags[4:].view(self.world_size, len(facts)).tolist()
            self.gathered_facts = [tuple(row) for row in gathered]
        return int(flags[0]), bool(flags[1]), bool(flags[2]), float(flags[3])

    def _all_reduce(self, tensor: torch.Tensor, op, what: str) -> None:
        """tensor reduced in place over every rank of the job, bounded by dist.timeout_s (what: named on a timeout)."""
        bounded(dist.all_reduce, tensor, op=op, group=None, timeout=self.timeout, what=what)

    def _save(self, iteration: int, capture: Callable[[], dict]) -> Path:
        """Every rank writes its file; rank 0 commits once all succeeded (a failure anywhere fails everywhere)."""
        error = None
        try:
            state = capture()
            state.update({ITERATION: iteration, RNG: capture_rng_state()})
        except UserError as exc:
            error = exc
        if self.sharded and self.distributed:
            # The sharded save is a collective of the trainers: a trainer whose capture failed and went on to the
            # vote below left its peers waiting inside DCP's gathers, every rank timed out in the vote, its line was
            # never printed and the job summary blamed a peer (fault pass 6, V5). So agree on the capture first.
            captured = torch.tensor([0 if error else 1], dtype=torch.int64)
            self._all_reduce(captured, dist.ReduceOp.MIN, f"checkpoint {iteration} capture all_reduce")
            if error is not None:
                raise error
            if not int(captured):
                raise UserError(
                    f"checkpoint of iteration {iteration} failed on another rank (see its line); the "
                    f"previous checkpoint stays the latest"
                )
        try:
            if error is None:
                self.store.save(state, iteration, self.rank)
        except UserError as exc:  # a full disk, a read-only directory: still take part in the vote below
            error = exc
        ok = torch.tensor([0 if error else 1], dtype=torch.int64)
        if self.distributed:
            self._all_reduce(ok, dist.ReduceOp.MIN, f"checkpoint {iteration} completion all_reduce")
        if error is not None:
            raise error
        if not int(ok):
            raise UserError(
                f"checkpoint of iteration {iteration} failed on another rank (see its line); the "
                f"previous checkpoint stays the latest"
            )
        directory = self.store.directory(iteration)
        if self.rank == 0:
            self.before_commit()
            self.store.commit(iteration, world_size=self.world_size)
            self.after_commit()
        return directory
