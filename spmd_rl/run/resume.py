"""Where a run starts, decided by rank 0 and agreed by all: the run directory (named once, the same on every rank),
a checkpoint to resume from or iteration 0 (a directory that would mix two runs is refused), and every rank's
check that it runs rank 0's exact config."""

from __future__ import annotations

import glob
import json
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from spmd_rl.comm.parallel_plan import shards
from spmd_rl.config.excerpts import excerpt
from spmd_rl.config.loading import load_config
from spmd_rl.config.sections import Config
from spmd_rl.persist.checkpoint import CheckpointStore, find_checkpoint
from spmd_rl.persist.event_files import repair_event_files
from spmd_rl.persist.fileio import make_dirs, write_atomic
from spmd_rl.persist.run_files import (
    BUFFER_DIR,
    CHECKPOINTS_DIR,
    COMPLETE_MARKER,
    CONFIG_FILE,
    FINISHED,
    METRICS_FILE,
    TENSORBOARD_DIR,
    finished_damage,
)
from spmd_rl.persist.run_lock import lock_run_dir, own_run_dirs
from spmd_rl.run.metrics import drop_records_after
from spmd_rl.runtime.distributed import broadcast_text
from spmd_rl.runtime.errors import SharedUserError, UserError
from spmd_rl.runtime.watchdog import watchdog


@dataclass
class Resume:
    """Where a run starts: iteration 0, or the iteration after a checkpoint (whose files every rank loads)."""

    checkpoint: Path | None = None
    iteration: int = -1  # the checkpoint's iteration (-1: a fresh start)
    note: str = ""  # rank 0: how the default run directory was chosen, for its first line
    fallback: str = ""  # rank 0: what was found that could not be followed, and what is done instead (a line)
    resharded: bool = False  # the checkpoint was saved by another number of ranks (train.parallel=fsdp)
    # rank 0, resuming: config.yaml as this start runs it, written at its first checkpoint (settle_start), so that a
    # start that fails before one leaves the run's config.yaml as it was
    config_text: str = ""

    @property
    def start_iteration(self) -> int:
        return self.iteration + 1


def agree_on_run(cfg: Config, runtime, dry_run: bool = False, algorithm_refusal: str = ""):
    """Rank 0 names the run directory and decides where the run starts (a checkpoint to resume from, or
    iteration 0; a run directory that would mix two runs is refused); every rank checks it runs rank 0's exact
    config; rank 0 saves it. algorithm_refusal: the algorithm's reshard_refusal. Returns (run directory, Resume)."""
    resume, verdict, note, fallback = Resume(), "", "", ""
    if runtime.rank == 0:
        run_dir, note = _default_run_dir(cfg, dry_run)
        if not dry_run:
            try:
                # one writer: a second copy of this command is refused here
                lock_run_dir(make_dirs(run_dir), named=bool(cfg.run.dir))
                resume = decide_resume(cfg, Path(run_dir), runtime.world_size, algorithm_refusal)
                verdict, fallback = str(resume.checkpoint or ""), resume.fallback
            except UserError as exc:
                verdict = f"error: {exc}"
    else:
        run_dir = ""
    if runtime.distributed:  # plain bytes: nothing is unpickled
        run_dir = broadcast_text(run_dir, src=0, timeout=runtime.timeout)
        verdict = broadcast_text(verdict, src=0, timeout=runtime.timeout)
    if verdict.startswith("error: "):
        raise SharedUserError(verdict[len("error: ") :])
    if verdict:
        resume = Resume(
            checkpoint=Path(verdict),
            iteration=checkpoint_iteration(Path(verdict)),
            resharded=saved_ranks(Path(verdict)) != runtime.world_size,
        )
    resume.note, resume.fallback = note, fallback
    cfg.run.dir = run_dir
    if runtime.distributed:
        mine = torch.frombuffer(bytearray.fromhex(cfg.digest()), dtype=torch.uint8)
        digests = [torch.empty_like(mine) for _ in range(runtime.world_size)]
        dist.all_gather(digests, mine)
        differing = [r for r, d in enumerate(digests) if not torch.equal(d, digests[0])]
        if differing:
            raise UserError(
                f"rank(s) {differing} run a different config than rank 0 (config hash differs); "
                f"give every rank the same --config file and the same overrides"
            )
    path = Path(run_dir)
    if runtime.rank == 0:
        make_dirs(path)  # a read-only or misplaced run.dir is a UserError naming it
        dropped = prepare_run_dir(path, resume)
        if dropped:  # damaged outputs of the run resumed: what went is said in rank 0's note line
            resume.fallback = f"{resume.fallback}; {dropped}" if resume.fallback else dropped
        if resume.checkpoint is None:  # a new run (or one started over): the directory is this start's from here
            write_atomic(path / CONFIG_FILE, cfg.to_yaml())
            own_run_dirs()
        else:
            resume.config_text = cfg.to_yaml()
    return path, resume


def settle_start(run_dir: Path, resume: Resume) -> None:
    """Rank 0, when this start commits a checkpoint: the run directory is this start's now. A resume writes its
    config.yaml (held back until here) and run.lock records this start's end from now on (before, a failed start
    puts back the note it found: persist/run_lock.py)."""
    if resume.config_text:
        write_atomic(run_dir / CONFIG_FILE, resume.config_text)
        resume.config_text = ""
    own_run_dirs()


def _default_run_dir(cfg: Config, dry_run: bool) -> tuple[str, str]:
    """The run directory and, when it was chosen here rather than given, a note saying why."""
    if dry_run:
        return tempfile.mkdtemp(prefix=f"spmd_rl-dry-run-{cfg.run.name}-"), ""
    if cfg.run.dir:
        return cfg.run.dir, ""
    if cfg.run.resume not in ("auto", "never"):  # a checkpoint path: continue in its run directory
        return str(find_checkpoint(cfg.run.resume).parent.parent), ""
    return command_run_dir(Path("runs"), f"{cfg.run.name}-{cfg.resume_digest()[:8]}", new=cfg.run.resume == "never")


def command_run_dir(root: Path, stem: str, new: bool) -> tuple[str, str]:
    """A command's own run directory, so that rerunning the same command resumes it: root/<stem> (the stem holds
    the config's resume digest: the same config under any launcher and after any restart), then <stem>-2, -3, ...
    for later runs of that config. The command continues the newest of them unless that one finished or `new` is
    set (run.resume=never): then it starts the next."""
    numbered = re.compile(re.escape(stem) + r"(?:-(\d+))?")
    runs = {}
    for path in root.glob(f"{glob.escape(stem)}*"):
        match = numbered.fullmatch(path.name)
        if match and path.is_dir():
            runs[int(match.group(1) or 1)] = path
    if not runs:
        return str(root / stem), "new: rerunning this command resumes it; run.resume=never starts another"
    newest = max(runs)
    # a damaged finished.json is no finish: the command continues in that run, where decide_resume names the file
    if not new and (not (runs[newest] / FINISHED).exists() or finished_damage(runs[newest])):
        return str(runs[newest]), "this command's unfinished run"
    why = "run.resume=never" if new else f"{runs[newest]} holds a finished run of this config"
    return str(root / f"{stem}-{newest + 1}"), f"new: {why}"


def decide_resume(cfg, run_dir: Path, world_size: int, algorithm_refusal: str = "") -> Resume:
    """Rank 0: where this run starts, from run.resume and what run_dir holds; refuses (UserError) to mix runs.

    auto: the latest checkpoint of run_dir, else a fresh start; never: a fresh start, refused if run_dir holds a
    run; a path: that checkpoint. A finished run, or one with another config, is never continued."""
    mode = cfg.run.resume
    store = CheckpointStore(run_dir, keep=cfg.checkpoint.keep)
    holds_run = (run_dir / CONFIG_FILE).exists()
    if mode == "never":
        if holds_run:
            raise UserError(
                f"run directory {run_dir} already holds a run and run.resume=never; choose another "
                f"run.dir, or set run.resume=auto to continue it"
            )
        return Resume()
    if mode == "auto":
        if not holds_run:
            return Resume()
        finished_note = finished_damage(run_dir)
        if finished_note:  # finished.json is written whole: one that does not parse was altered, and says nothing
            raise UserError(
                f"{finished_note}: a run writes it whole when it finishes, so this one was altered; if the run did not "
                f"finish (python -m spmd_rl.runs {run_dir} shows how it ended), remove the file and rerun to resume "
                f"from its latest checkpoint; if it did, restore the file from a copy; this run directory is left "
                f"as it is"
            )
        if (run_dir / FINISHED).exists():
            raise UserError(
                f"run directory {run_dir} holds a finished run; choose another run.dir (or run.init_from="
                f"{run_dir} to fine-tune from it)"
            )
        checkpoint, fallback = store.latest_sound_and_why()
        config_dir = run_dir
    else:
        checkpoint, fallback = find_checkpoint(mode), ""
        config_dir = checkpoint.parent.parent
        if config_dir.resolve() != run_dir.resolve():
            raise UserError(
                f"run.resume={mode} continues the run in {config_dir}, not in run.dir={run_dir}; leave "
                f"run.dir unset (or set it to {config_dir}), or start a new run from those weights with "
                f"run.init_from={mode}"
            )
    try:
        previous = load_config(config_dir / CONFIG_FILE)
    except UserError as exc:
        # the loader's advice is for a --config file: the run's own config.yaml is restored, not replaced
        problem = str(exc).split("; pass --config")[0].split("; give it sections")[0]
        raise UserError(
            f"cannot resume from {config_dir}: its config.yaml does not load ({problem}); restore it from a copy (it "
            f"is the config the run started with), or give this command another run.dir"
        ) from None
    finally:  # loading a config bounds the process's watchdog by its dist.timeout_s: this run's bound is the one
        watchdog.rebound(cfg.dist.timeout_s)
    # The same run, on the same layout or (resharding, sharded runs only) another; everything else must match.
    if previous.resume_digest(with_layout=False) != cfg.resume_digest(with_layout=False):
        if mode == "auto" and checkpoint is None and not _has_records(run_dir / METRICS_FILE):
            # a start of another config that failed before its first iteration: nothing of it to keep or continue,
            # and refusing would leave the corrected command no way into its own run.dir
            replaced = f"{run_dir} held a start of another config that ended before its first iteration: replaced"
            return Resume(fallback=f"{fallback}; {replaced}" if fallback else replaced)
        raise UserError(
            f"run directory {config_dir} holds a run with a different config (beyond run, checkpoint and "
            f"log keys){config_difference(previous, cfg)}; rerun with its config.yaml, or choose another run.dir "
            f"(with run.init_from={config_dir} to start from its weights, e.g. to train longer)"
        )
    if checkpoint is None:  # the same run, stopped before its first checkpoint: it starts over (see prepare_run_dir)
        damaged = store.damaged_markers()
        if damaged:  # not "no checkpoint": starting over would clear a checkpoint whose weights may be whole
            raise UserError(
                f"checkpoint marker {damaged[-1] / COMPLETE_MARKER} is damaged (a save writes it whole) and the run "
                f"has no complete checkpoint besides: restore the file from a copy, or start a new run in another "
                f"run.dir; this run directory is left as it is"
            )
        held = [name for name in (METRICS_FILE, BUFFER_DIR, TENSORBOARD_DIR) if (run_dir / name).exists()]
        if held:
            cleared = f"{run_dir} holds this run's {', '.join(held)} but no checkpoint: cleared, the run starts over"
            fallback = f"{fallback}; {cleared}" if fallback else cleared
        return Resume(fallback=fallback)
    blocked = store.pointer_blocked()
    if blocked:  # refused now, not at the first checkpoint after training up to it
        raise UserError(blocked)
    ranks = saved_ranks(checkpoint)
    resharded = ranks != world_size or previous.resume_digest() != cfg.resume_digest()
    if resharded:
        why = reshard_refusal(cfg, shards(previous.train.parallel) and shards(cfg.train.parallel), algorithm_refusal)
        if why:
            raise UserError(
                f"checkpoint {checkpoint} holds {ranks} rank(s) of layout {_layout_text(previous)} but this run has "
                f"{world_size} of layout {_layout_text(cfg)}; resume with the checkpoint's layout: "
                f"{_layout_change(previous, cfg, ranks, world_size)} ({why})"
            )
        changed = (
            f"checkpoint {checkpoint} was saved by {ranks} rank(s) ({_layout_text(previous)}), this run has "
            f"{world_size} ({_layout_text(cfg)}): the model and optimizer are resharded from its shard files and "
            f"the rest of the learner's state comes from trainer 0's; env episodes start fresh and every rank's "
            f"random streams are seeded anew, so the run goes on, but not as {ranks} rank(s) would have continued "
            f"it (the data order differs)"
        )
        fallback = f"{fallback}; {changed}" if fallback else changed
    return Resume(
        checkpoint=checkpoint, iteration=checkpoint_iteration(checkpoint), fallback=fallback, resharded=resharded
    )


def saved_ranks(checkpoint: Path) -> int:
    """How many ranks saved this checkpoint (its rank files)."""
    return len(list(checkpoint.glob("rank*.pt")))


def reshard_refusal(cfg: Config, sharded: bool, algorithm_refusal: str = "") -> str:
    """Why a checkpoint of another rank count or layout cannot be resumed by this config ('' when it can)."""
    if not sharded:
        return "only train.parallel=fsdp checkpoints reshard"
    if algorithm_refusal:
        return f"algo.class '{cfg.classes['algo']}': {algorithm_refusal}"
    if not cfg.env.total_envs:
        return "resharding needs env.total_envs, so that an iteration keeps its env steps"
    if cfg.buffer.log_experience:
        return "the experience log is written per rank; set buffer.log_experience=false to reshard"
    return ""


def _layout_change(previous: Config, cfg: Config, ranks: int, world_size: int) -> str:
    """What to change for a run to have the checkpoint's layout: the layout keys whose values differ (a colocated
    layout reads no role counts) and the number of ranks."""
    names = ("mode",) if previous.layout.mode == "colocated" else ("mode", "trainer", "inference", "env")
    keys = [
        f"layout.{name}={getattr(previous.layout, name)}"
        for name in names
        if getattr(previous.layout, name) != getattr(cfg.layout, name)
    ]
    change = [f"set {' '.join(keys)}"] if keys else []
    if ranks != world_size:
        change.append(f"start {ranks} rank{'' if ranks == 1 else 's'}")
    return " and ".join(change) or "the same config.yaml"


def _layout_text(cfg: Config) -> str:
    layout = cfg.layout
    if layout.mode == "colocated":
        return "colocated"
    return f"split: trainer {layout.trainer}, inference {layout.inference}, env {layout.env}"


def config_difference(previous: Config, cfg: Config, shown: int = 5) -> str:
    """': key old -> new, ...' for the keys a resume must keep (those Config.resume_digest hashes) whose values
    differ, at most `shown` of them; '' when none is found."""
    old, new = _resume_keys(previous), _resume_keys(cfg)
    absent = object()
    changed = [key for key in sorted(old.keys() | new.keys()) if old.get(key, absent) != new.get(key, absent)]
    if not changed:
        return ""

    def value(values: dict, key: str) -> str:
        return excerpt(values[key]) if key in values else "(absent)"

    listed = ", ".join(f"{key} {value(old, key)} -> {value(new, key)}" for key in changed[:shown])
    more = f" and {len(changed) - shown} more" if len(changed) > shown else ""
    return f": {listed}{more}"


def _resume_keys(cfg: Config) -> dict:
    """Config.resume_dict() as dotted keys."""
    flat: dict = {}

    def walk(prefix: str, value) -> None:
        if isinstance(value, dict):  # an empty one adds no key: {} -> {a: 1} is one difference, a
            for key, item in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), item)
        elif isinstance(value, list) and value and all(isinstance(item, dict) for item in value):
            for i, item in enumerate(value):
                walk(f"{prefix}[{i}]", item)
        else:
            flat[prefix] = value

    walk("", cfg.resume_dict())
    return flat


def checkpoint_iteration(checkpoint: Path) -> int:
    return int(checkpoint.name.split("_")[-1])


def prepare_run_dir(run_dir: Path, resume: Resume) -> str:
    """Rank 0: make run_dir's outputs consistent with where the run starts. Resuming, nothing is changed here:
    metrics.jsonl will keep the records up to the checkpoint (HDF5 files are rewound by their owners, TensorBoard by
    purge_step) and damaged lines and event records will be dropped when this start commits its first checkpoint
    (MetricsLogger.open_files), so a start that fails before leaves them as they were; returns what will be dropped
    ('' when nothing). Starting over in a directory of the same run that had no checkpoint, its outputs are
    cleared."""
    if resume.checkpoint is not None:
        dropped = [
            drop_records_after(run_dir / METRICS_FILE, resume.iteration, write=False),
            repair_event_files(run_dir / TENSORBOARD_DIR, write=False),
        ]
        return "; ".join(note for note in dropped if note)
    for name in (METRICS_FILE, TENSORBOARD_DIR, BUFFER_DIR, CHECKPOINTS_DIR):
        path = run_dir / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    return ""


def mark_finished(run_dir: Path, given_digest: str, ranks: list[dict]) -> None:
    """A finished run's directory is never resumed (decide_resume). given_digest: the config's resume digest as the
    command gave it (config.yaml holds env counts the plan resolved for this world size); ranks: one record per rank
    (docs/runs.md)."""
    record = {"finished": True, "config_digest": given_digest, "ranks": ranks}
    write_atomic(run_dir / FINISHED, json.dumps(record) + "\n")


def _has_records(metrics: Path) -> bool:
    """Whether metrics.jsonl may hold an iteration's record: True unless it is absent or an empty regular file
    (anything else, unreadable or not a file, counts as holding one: the run directory is then refused as before)."""
    if not metrics.exists() and not metrics.is_symlink():
        return False
    try:
        return not metrics.is_file() or metrics.stat().st_size > 0
    except OSError:
        return True
