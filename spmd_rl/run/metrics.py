"""What the user sees, on rank 0 only: a progress bar, a compact line every few seconds, metrics.jsonl,
TensorBoard events, and a final summary line.

metrics.jsonl gets one whole line per iteration in one write (fileio.LineAppender): after a crash or on a full disk
it ends with the last whole record, never half of one.

Iterations count from 0 everywhere: metrics.jsonl's `iteration`, the console's `iter`, the checkpoints' iter_N and
the stop and resume lines. Timings are this process's: after a resume, `wall_s` and `cpu_s` count from the resume
and `sps` is the env steps taken since the resume over that time (env_steps itself is the run's total).

For envs that report a success flag (envs/success.py), success_rate and success_at_end_rate are over the episodes
that ended in the iteration (null when none did), per env group too; other envs' records have neither key.
"""

from __future__ import annotations

import collections
import json
import math
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from tqdm import tqdm

from spmd_rl.persist.event_files import repair_event_files
from spmd_rl.persist.fileio import LineAppender, NotRegularFile, bounded_lines, file_error, open_regular, write_atomic
from spmd_rl.persist.run_files import METRICS_FILE, METRICS_LINE_BYTES, TENSORBOARD_DIR
from spmd_rl.runtime.errors import UserError

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

# The mean over the last RETURN_WINDOW finished episodes (all env ranks) is the headline return.
RETURN_WINDOW = 20


class MetricsLogger:
    def __init__(
        self,
        run_dir: Path,
        total_steps: int,
        progress: bool | None,
        interval_s: float,
        tensorboard: bool,
        resumed_env_steps: int = 0,
        trackers=None,
        group_names: Sequence[str] = (),
        rollouts: bool = True,
        resumed_iteration: int | None = None,
    ):
        self.run_dir = run_dir
        # False for a run without rollouts (bc: Schedule.rollout_unit "none"): its records and lines have no env
        # timings, steps or returns, which would all read 0 or "no episode has ended yet"
        self.rollouts = rollouts
        self.total_steps = total_steps
        self.resumed_env_steps = resumed_env_steps  # env steps before this process: the timings leave them out
        self.interval_s = interval_s
        self.trackers = trackers  # trackers.Trackers (W&B, MLflow) or None: they get TensorBoard's scalars
        self.tensorboard = tensorboard
        self.jsonl: LineAppender | None = None
        self.writer: SummaryWriter | None = None
        # Resuming (from the checkpoint of resumed_iteration), the files are left as they are until this start
        # commits a checkpoint of its own (open_files): a start that fails or is killed before it changes neither
        # metrics.jsonl nor TensorBoard's events. Its records wait here meanwhile, (line, scalars, env steps).
        self.resumed_iteration = resumed_iteration
        self.held: list[tuple[str, dict[str, float], int]] = []
        if resumed_iteration is None:
            self.open_files()
        show_bar = sys.stderr.isatty() if progress is None else progress
        self.bar = tqdm(
            total=total_steps,
            initial=resumed_env_steps,
            unit="step",
            unit_scale=True,
            dynamic_ncols=True,
            disable=not show_bar,
        )
        self.recent_returns: collections.deque[float] = collections.deque(maxlen=RETURN_WINDOW)
        self.recent_lengths: collections.deque[float] = collections.deque(maxlen=RETURN_WINDOW)
        # With env groups, the same windows per group (episode_return_mean/<name>, episode_length_mean/<name>).
        self.group_names = list(group_names)
        self.group_returns: list[collections.deque[float]] = [
            collections.deque(maxlen=RETURN_WINDOW) for _ in self.group_names
        ]
        self.group_lengths: list[collections.deque[float]] = [
            collections.deque(maxlen=RETURN_WINDOW) for _ in self.group_names
        ]
        self.episodes = 0
        self.start = time.perf_counter()
        self.start_cpu = time.process_time()
        self.last_line = -math.inf
        self.last_record: dict = {}

    def open_files(self) -> None:
        """Open metrics.jsonl and TensorBoard's writer and write the records held since the resume: at the start of
        a new run, and when a resumed one commits its first checkpoint (RunControl.before_commit, before the
        checkpoint counts), where the records a stopped run logged after the resumed checkpoint are dropped and
        damaged lines and event records go (run/resume.py prepare_run_dir named them at the start)."""
        if self.jsonl is not None:
            return
        if self.resumed_iteration is not None:
            drop_records_after(self.run_dir / METRICS_FILE, self.resumed_iteration)
            repair_event_files(self.run_dir / TENSORBOARD_DIR)
        self.jsonl = LineAppender(self.run_dir / METRICS_FILE)
        if self.tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # imported only where used: it is slow to import

            try:
                # A resumed run drops the events a stopped run wrote after its checkpoint (purge_step), so TensorBoard
                # continues at the right step.
                self.writer = SummaryWriter(
                    log_dir=str(self.run_dir / TENSORBOARD_DIR),
                    purge_step=self.resumed_env_steps + 1 if self.resumed_env_steps else None,
                )
            except OSError as exc:
                self.jsonl.close()
                raise file_error(self.run_dir / TENSORBOARD_DIR, exc, "cannot create TensorBoard's directory") from None
        held, self.held = self.held, []
        for line, scalars, env_steps in held:
            self._write_files(line, scalars, env_steps)

    def _write_files(self, line: str, scalars: dict[str, float], env_steps: int) -> None:
        """One record into metrics.jsonl and TensorBoard, or held until open_files."""
        if self.jsonl is None:
            self.held.append((line, scalars, env_steps))
            return
        self.jsonl.append(line)
        if self.writer is not None:
            self._write_scalars(scalars, env_steps)

    def record(self, iteration: int, env_steps: int, losses: dict, statistics: dict, trainer_times: dict) -> dict:
        """This iteration's metrics.jsonl line (episode statistics folded into the recent window), not yet
        written: callbacks see it whole and may add scalars before `write`."""
        self.recent_returns.extend(statistics["returns"].tolist())
        self.recent_lengths.extend(statistics["lengths"].tolist())
        self.episodes += statistics["returns"].numel()
        per_group = {}
        if self.group_names:
            groups = statistics["groups"].long()
            for index, name in enumerate(self.group_names):
                mine = groups == index
                self.group_returns[index].extend(statistics["returns"][mine].tolist())
                self.group_lengths[index].extend(statistics["lengths"][mine].tolist())
                per_group[f"episode_return_mean/{name}"] = _mean(self.group_returns[index])
                per_group[f"episode_length_mean/{name}"] = _mean(self.group_lengths[index])
        success = success_rates(statistics, self.group_names)
        elapsed = time.perf_counter() - self.start
        env_ranks = max(statistics["env_ranks"], 1.0)
        inference_s = statistics["inference_s"] / env_ranks
        rollout_times = (
            {
                # seconds per phase in this iteration; env-side phases are means over env ranks
                "time_env_s": statistics["env_s"] / env_ranks,
                "time_inference_s": inference_s,
                "time_transfer_s": max(statistics["action_wait_s"] / env_ranks - inference_s, 0.0),
                # the rollout's own time and what each side idled in it (env ranks waiting for actions, the inference
                # rank for observations): with env.pipeline_stages the rollout is less than env + inference time
                "time_rollout_s": statistics["rollout_s"] / env_ranks,
                "time_env_idle_s": statistics["action_wait_s"] / env_ranks,
                "time_inference_idle_s": statistics["inference_idle_s"] / env_ranks,
            }
            if self.rollouts
            else {}
        )
        record = {
            "iteration": iteration,
            "env_steps": env_steps,
            "episodes": self.episodes,
            "episode_return_mean": _mean(self.recent_returns),
            "episode_length_mean": _mean(self.recent_lengths),
            **per_group,
            **success,
            "sps": (env_steps - self.resumed_env_steps) / elapsed if elapsed > 0 else 0.0,  # this process's
            **losses,
            **rollout_times,
            **trainer_times,
            "wall_s": elapsed,  # since this process started the run (or resumed it)
            "cpu_s": time.process_time() - self.start_cpu,  # this rank's CPU time: robust to a busy machine
        }
        return record

    def write(self, record: dict) -> None:
        """Append the record to metrics.jsonl and TensorBoard; update the progress bar and the periodic line."""
        elapsed, env_steps = record["wall_s"], record["env_steps"]
        # JSON has no NaN: an iteration before the first finished episode has no return yet.
        line = json.dumps({k: _finite_or_none(v) for k, v in record.items()})
        scalars = {
            key: value
            for key, value in record.items()
            if key not in ("iteration", "env_steps") and value is not None and math.isfinite(value)
        }
        self._write_files(line, scalars, env_steps)
        if self.trackers is not None:
            self.trackers.log(scalars, env_steps)
        self.bar.update(env_steps - self.bar.n)
        shown = f"{record['episode_return_mean']:.1f}" if record["episodes"] else "-"  # no episode has ended yet
        self.bar.set_postfix(ret=shown, sps=f"{record['sps']:.0f}", refresh=False)
        # An evaluation is printed whenever it comes: off-policy runs (DQN, TD3) make many short iterations, and
        # the one line in log.interval_s seconds almost never fell on the iteration of an evaluation.
        if elapsed - self.last_line >= self.interval_s or "eval_return_mean" in record:
            self.last_line = elapsed
            self._print(self.line(record, self.rollouts))
        self.last_record = record

    def _write_scalars(self, scalars: dict[str, float], env_steps: int) -> None:
        """The iteration's scalars as one TensorBoard event: each value as add_scalar writes it (a float32
        simple_value under its tag, at step env_steps), but one Summary for all of them, not an event (and a
        protobuf, a queue put and a record) per key, which cost ~1.5 ms an iteration for ~20 keys."""
        from tensorboard.compat.proto.summary_pb2 import Summary

        values = [Summary.Value(tag=key, simple_value=value) for key, value in scalars.items()]
        # the file writer add_scalar writes through (created on first use: it applies purge_step)
        assert self.writer is not None  # called with TensorBoard on
        self.writer._get_file_writer().add_summary(Summary(value=values), env_steps)

    def state_dict(self) -> dict:
        """What the next records depend on, for a checkpoint (timings restart)."""
        state = {
            "episodes": self.episodes,
            "recent_returns": list(self.recent_returns),
            "recent_lengths": list(self.recent_lengths),
        }
        if self.group_names:
            state["group_returns"] = [list(window) for window in self.group_returns]
            state["group_lengths"] = [list(window) for window in self.group_lengths]
        return state

    def load_state_dict(self, state: dict) -> None:
        self.episodes = state["episodes"]
        self.recent_returns.extend(state["recent_returns"])
        self.recent_lengths.extend(state["recent_lengths"])
        if self.group_names:
            for window, values in zip(self.group_returns, state["group_returns"]):
                window.extend(values)
            for window, values in zip(self.group_lengths, state["group_lengths"]):
                window.extend(values)

    # The losses worth a glance, per algorithm, in the compact line (all of them are in metrics.jsonl).
    GLANCE = (
        ("approx_kl", "kl", ".4f"),
        ("clip_fraction", "clip", ".3f"),
        ("qf_loss", "qf", ".3f"),
        ("alpha", "alpha", ".3f"),
        ("nll_loss", "nll", ".3f"),
    )

    @classmethod
    def line(cls, record: dict, rollouts: bool = True) -> str:
        text = f"iter {record['iteration']:>5}"
        if rollouts:
            if record["episodes"]:
                episodes = f"return {record['episode_return_mean']:8.2f}  len {record['episode_length_mean']:7.1f}"
            else:  # the mean of no returns is NaN: say why there is none
                episodes = "no episode has ended yet"
            text += f"  steps {record['env_steps']:>9}  {episodes}  sps {record['sps']:8.0f}"
        elif "time_learn_s" in record:  # no rollouts (bc): the iteration is its update
            text += f"  learn {record['time_learn_s']:.3f}s"
        for key, label, spec in cls.GLANCE:
            if key in record:
                text += f"  {label} {record[key]:{spec}}"
        if "time_rollout_s" in record:  # where the rollout's time went, and which side waited for the other
            text += (
                f"  rollout {record['time_rollout_s']:.3f}s: env {record['time_env_s']:.3f}s, inference "
                f"{record['time_inference_s']:.3f}s, idle env {record['time_env_idle_s']:.3f}s / inference "
                f"{record['time_inference_idle_s']:.3f}s"
            )
        if "eval_return_mean" in record:  # this iteration's evaluation (eval.every)
            text += f"  eval {record['eval_return_mean']:.2f} ± {record.get('eval_return_std', 0.0):.2f}"
            if record.get("eval_success_rate") is not None:
                text += f" success {record['eval_success_rate']:.2f}"
        if rollouts and record.get("success_rate") is not None:  # envs that report success: "-" while no episode
            text += f"  success {_shown(record['success_rate'], '.2f')}"  # ended this iteration (NaN)
        groups = [key.split("/", 1)[1] for key in record if key.startswith("episode_return_mean/")]
        if groups:  # env groups: each one's return, briefly
            text += "  (" + " ".join(f"{name} {_shown(record[f'episode_return_mean/{name}'])}" for name in groups) + ")"
        return text

    def _print(self, text: str) -> None:
        if self.bar.disable:
            print(text, flush=True)
        else:
            self.bar.write(text)

    def close(self, summary: bool, stopped: bool = False) -> None:
        """Close the files; print the final summary line when the run finished (not after a failure). The
        trackers record whether the run finished, stopped with a checkpoint, or failed."""
        self.bar.close()
        record = self.last_record
        if summary:
            env_steps, wall_s, sps = record.get("env_steps", 0), record.get("wall_s", 0.0), record.get("sps", 0.0)
            if self.resumed_env_steps:  # the timings are this process's: say which steps they cover
                steps = (
                    f"{env_steps} env steps, {env_steps - self.resumed_env_steps} of them since the resume in "
                    f"{wall_s:.1f}s ({sps:.0f} steps/s)"
                )
            else:
                steps = f"{env_steps} env steps in {wall_s:.1f}s ({sps:.0f} steps/s)"
            returns = (
                f"mean return of the last {RETURN_WINDOW} episodes {record['episode_return_mean']:.2f}"
                if self.episodes
                else "no episode ended, so no return"
            )
            done = f"{steps}, {self.episodes} episodes, {returns}"
            if not self.rollouts:  # bc: no env steps or episodes to count
                done = f"{record.get('iteration', -1) + 1} iterations (no rollouts), this process's in {wall_s:.1f}s"
            print(f"done: {done}; run directory {self.run_dir}", flush=True)
        if self.writer is not None:
            self.writer.close()
        if self.trackers is not None:
            self.trackers.close("finished" if summary else "stopped" if stopped else "failed")
        if self.jsonl is not None:
            self.jsonl.close()
        self.held.clear()  # a resume that ends before its first checkpoint: its records go with it


def success_rates(statistics: dict, group_names: list[str]) -> dict[str, float]:
    """success_rate and success_at_end_rate over the episodes that ended this iteration (NaN when none did), per
    env group too; {} for envs that report no success flag."""
    if "successes" not in statistics:
        return {}
    rates = {}
    subsets = [("", slice(None))]
    if group_names:
        groups = statistics["groups"].long()
        subsets += [(f"/{name}", groups == index) for index, name in enumerate(group_names)]
    for suffix, mine in subsets:
        for name, key in (("success_rate", "successes"), ("success_at_end_rate", "successes_at_end")):
            values = statistics[key][mine]
            rates[name + suffix] = values.mean().item() if values.numel() else float("nan")
    return rates


def _shown(mean: float, spec: str = ".1f") -> str:
    """A mean for the console: '-' while it is NaN (no episode of it has ended yet)."""
    return "-" if mean != mean else f"{mean:{spec}}"


def _finite_or_none(value):
    return None if isinstance(value, float) and not math.isfinite(value) else value


def _mean(values) -> float:
    return sum(values) / len(values) if values else float("nan")


def last_record(path: Path) -> dict:
    """The last whole record of a metrics.jsonl ({} when it has none)."""
    records = [record for _, _, record in _records(path) if record is not None]  # a damaged line is skipped
    return records[-1] if records else {}


def drop_records_after(path: Path, iteration: int, write: bool = True) -> str:
    """Keep the records of iterations <= iteration (a resumed run rewrites those a stopped run logged after its
    checkpoint); the file is replaced atomically. Damaged lines (torn by a kill, bytes that are not UTF-8 from a
    disk error, anything that is not a record) are dropped wherever they are, and every sound record is kept.
    Returns what was damaged and dropped, for a note ('' when nothing was); write=False: only the note, the file
    stays as it is."""
    if not path.exists():
        return ""
    kept, damaged = [], []
    for number, line, record in _records(path):
        if record is None or not isinstance(record.get("iteration"), int):
            damaged.append(number)
        elif record["iteration"] <= iteration:
            kept.append(line)
    if write:
        write_atomic(path, "".join(f"{line}\n" for line in kept))
    if not damaged:
        return ""
    shown = ", ".join(map(str, damaged[:5])) + (f" and {len(damaged) - 5} more" if len(damaged) > 5 else "")
    return f"{path}: dropped {len(damaged)} damaged line(s) (line {shown}: not a whole JSON record); kept the rest"


def _records(path: Path) -> Iterator[tuple[int, str, dict | None]]:
    """(number, text, record) of each line of a metrics.jsonl (none when it is missing); record is None for a damaged
    line: not UTF-8, no JSON object, longer than METRICS_LINE_BYTES, or brackets nested past the parser's recursion.
    A metrics.jsonl that is no regular file (a FIFO, a link to /dev/zero) is a UserError, never a hang."""
    try:
        file = open_regular(path)
    except FileNotFoundError:
        return
    except NotRegularFile as exc:
        raise UserError(f"{exc}: a run's metrics.jsonl is a file it appends to; move it away and rerun") from None
    except OSError as exc:
        raise file_error(path, exc, "cannot read") from None
    with file:
        for number, raw in enumerate(bounded_lines(file, METRICS_LINE_BYTES), start=1):
            if raw is None:  # too long
                yield number, "", None
                continue
            try:
                line = raw.decode()
                record = json.loads(line)
            except (ValueError, RecursionError):  # not UTF-8, no JSON, nested
                yield number, "", None
                continue
            yield number, line, record if isinstance(record, dict) else None
