"""The names of what a run directory holds, defined once: the run writes them, resume, the sweep, plot, evaluate
and load_policy read them. Plain names, no torch, so the tools that only look at run directories import this alone.
docs/running.md ("What a run writes") lists them for users."""

from __future__ import annotations

import json
from pathlib import Path

from spmd_rl.persist.fileio import NotRegularFile, open_regular

CONFIG_FILE = "config.yaml"  # the resolved config
METRICS_FILE = "metrics.jsonl"  # one JSON record per iteration
METRICS_LINE_BYTES = 1 << 20  # a metrics line longer than this is damage (a record is a few hundred bytes)
TENSORBOARD_DIR = "tensorboard"
POLICY_FILE = "policy.pt"  # the Policy's state_dict, at the end or on a stop
CHECKPOINTS_DIR = "checkpoints"  # iter_<N>/rank<R>.pt per rank, and `latest`
CHECKPOINT_PREFIX = "iter_"  # checkpoints/iter_<N>: one checkpoint directory, N the iteration (9 digits)
COMPLETE_MARKER = "COMPLETE"  # in a checkpoint directory once every rank saved: the rank files' names and sizes
SHARDS_DIR = "shards"  # in a checkpoint of sharded trainers: torch.distributed.checkpoint's files
SHARDS_METADATA = ".metadata"  # DCP's index of the shard files, without which none of them loads
BUFFER_DIR = "buffer"  # HDF5 experience logs and replay shards
LOCK_FILE = "run.lock"  # flocked by rank 0 beside the run directory while the run lives; the holder's note
FINISHED = "finished.json"  # written by rank 0 when a run completed: such a directory is never resumed
BEST_DIR = "best"  # checkpoint.keep_best: <run dir>/best/policy.pt and its score.json
SCORE_FILE = "score.json"
VIDEO_DIR = "videos"  # eval.video_every: <run dir>/videos/iter_<I>/
FINISHED_BYTES = 1 << 20  # finished.json: a few hundred bytes a rank


def finished_damage(run_dir: Path) -> str:
    """Why run_dir's finished.json is no finished run's record ('' when it is one, or absent): a run writes it whole
    (write then rename) when it finishes, so one that does not parse was altered or planted, and neither a resume
    nor the runs index may take it for a finished run. Bounded: only a regular file is read, FINISHED_BYTES of it."""
    path = run_dir / FINISHED
    try:
        with open_regular(path) as file:
            text = file.read(FINISHED_BYTES + 1)
    except FileNotFoundError:
        return ""
    except NotRegularFile as exc:
        return str(exc)
    except OSError as exc:
        return f"{path} cannot be read ({exc.strerror})"
    try:
        if len(text) > FINISHED_BYTES:
            raise ValueError(f"larger than {FINISHED_BYTES >> 20} MiB")
        record = json.loads(text)
    except (ValueError, RecursionError) as exc:
        return f"{path} is no JSON record ({str(exc).splitlines()[0] if str(exc) else 'nested too deep'})"
    if not isinstance(record, dict) or record.get("finished") is not True:
        return f'{path} is no finished run\'s record (no "finished": true)'
    return ""
