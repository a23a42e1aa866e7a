"""Learning curves from run directories: `python -m spmd_rl.plot RUN_DIR [RUN_DIR ...] -o curves.png`.

Each run's metrics.jsonl gives one curve (--y against --x). Runs whose config.yaml differ only in train.seed (and
run.dir / run.name) are seeds of one experiment: they are drawn as one curve, the mean over seeds with the min-max
spread shaded, on a common x grid over the range every seed reached. Runs with the same config and the same seed
are not seeds of one experiment (they differ in something config.yaml does not hold, such as the number of ranks)
and are drawn one by one.

A directory that is no run but holds runs (a sweep's directory from `python -m spmd_rl.sweep`, or runs/) stands for
the runs in it: a sweep's in the order of its sweep.json, skipping (with a note) those that logged nothing yet.

matplotlib is an optional extra: pip install -e ".[plot]".

Over 400 lines: reading runs, grouping seeds and drawing are one short path a reader follows top to bottom.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

import numpy as np
import yaml

from spmd_rl.config.excerpts import clip
from spmd_rl.config.loading import MAX_CONFIG_BYTES, ConfigLoader
from spmd_rl.persist.fileio import NotRegularFile, open_regular
from spmd_rl.persist.run_files import CONFIG_FILE, METRICS_FILE
from spmd_rl.runtime.errors import USER_ERROR_EXIT_CODE, UserError

if TYPE_CHECKING:  # annotations only: matplotlib is the plot extra's, imported when plotting
    from matplotlib.backends.backend_agg import FigureCanvasAgg

# What a curve's identity ignores when grouping seeds.
_PER_RUN_KEYS = (("train", "seed"), ("run", "dir"), ("run", "name"))
GRID_POINTS = 200
SEARCH_DEPTH = 3  # how deep a directory of runs is searched: runs/<sweep>/<run>
LABEL_DETAIL_CHARS = 100  # a legend line of about the figure's width
LINE_STYLES = ("-", "--", ":", "-.")
EXPERIMENT_KEYS = ("env.id", "algo.class", "policy.class")  # what labels name first: see distinguishing_keys
COLOUR_ORDER = (*range(0, 20, 2), *range(1, 20, 2))  # matplotlib's tab20: its ten strong colours, then the pale
AXES_INCHES = (8.0, 4.5)
LEGEND_ONE_COLUMN_MAX = 8  # more curves than this: two columns, if their labels are short enough
LEGEND_TWO_COLUMN_CHARS = 55
LABELS = {
    "env_steps": "env steps",
    "iteration": "iteration",
    "wall_s": "wall-clock seconds",
    "episode_return_mean": "episode return (mean of the last 20 episodes)",
    "episode_length_mean": "episode length (mean of the last 20 episodes)",
}


@dataclass
class Run:
    directory: Path
    config: dict
    records: list[dict]

    @property
    def seed(self):
        return self.config.get("train", {}).get("seed")

    def curve(self, x: str, y: str) -> tuple[np.ndarray, np.ndarray]:
        """The (x, y) points where both are numbers (y is null before the first finished episode)."""
        points = [(r[x], r[y]) for r in self.records if _is_number(r.get(x)) and _is_number(r.get(y))]
        if not points:
            keys = sorted({k for r in self.records for k, v in r.items() if _is_number(v)})
            raise UserError(
                f"{self.directory / 'metrics.jsonl'} has no values of '{y}' against '{x}': "
                f"choose --x and --y among {', '.join(keys)}"
            )
        xs, ys = np.array(points, dtype=np.float64).T
        return xs, ys


@dataclass
class Curve:
    label: str
    x: np.ndarray
    mean: np.ndarray
    low: np.ndarray | None = None  # min over seeds, for a group
    high: np.ndarray | None = None  # max over seeds


def read_metrics(run_dir: Path) -> list[dict]:
    """The records of run_dir/metrics.jsonl, one per iteration (the last written wins, as after a resume that
    repeated iterations), in iteration order. A torn last line (a run killed mid-write) is skipped."""
    path = run_dir / METRICS_FILE
    if os.path.lexists(path) and not path.is_file():  # a FIFO, a device or a directory: nothing to read
        raise UserError(f"{path} is not a regular file: move it away, or give the directory of another run")
    if not path.is_file():
        raise UserError(f"{run_dir} has no metrics.jsonl: give the directory of a run (its run.dir)")
    lines = path.read_text(errors="replace").splitlines()  # bytes that are not UTF-8: a damaged line, named below
    by_iteration: dict = {}
    for number, line in enumerate(lines, start=1):
        try:
            record = json.loads(line)
            if not isinstance(record, dict):
                raise ValueError("not a JSON object")
        except (ValueError, RecursionError):  # no JSON, a bare value, or brackets nested past Python's recursion
            # limit: a RecursionError traceback (fault pass 6, R2), as `42` was an AttributeError one
            if number == len(lines):
                break  # torn by a kill during the write
            raise UserError(f"{path}:{number} is not a JSON line: the file is damaged; remove that line") from None
        iteration = record.get("iteration", number)
        if not isinstance(iteration, int) or isinstance(iteration, bool):  # null or "3" was a TypeError traceback
            # in the sort below (fault pass 9, T1)
            raise UserError(
                f"{path}:{number} has iteration {clip(repr(iteration))}, not a whole number: the file is damaged; "
                f"remove that line"
            )
        by_iteration[iteration] = record
    if not by_iteration and lines and lines[-1].strip():  # a 30 MB file is not "empty" (fault pass 7, R2)
        raise UserError(
            f"{path} holds no complete line: its only line ({len(lines[-1].encode(errors='replace'))} bytes) is torn "
            f"or no JSON record (a run killed while writing it, or a damaged file); the run logged no whole iteration"
        )
    if not by_iteration:
        raise UserError(f"{path} is empty: the run logged no iteration yet")
    return [by_iteration[k] for k in sorted(by_iteration)]


def read_run(run_dir: Path) -> Run:
    if not run_dir.is_dir():
        raise UserError(f"run directory {run_dir} does not exist")
    records = read_metrics(run_dir)
    return Run(run_dir, read_config(run_dir / CONFIG_FILE), records)


def read_config(config_path: Path) -> dict:
    """A run's config.yaml ({} when there is none), read as spmd_rl.runs reads it: a regular file only, at most
    MAX_CONFIG_BYTES, through the config's own bounded loader. yaml.safe_load of a value nested 100000 deep was a
    RecursionError traceback, and an alias bomb would have expanded without end (fault pass 7, R7)."""
    try:
        with open_regular(config_path) as file:
            text = file.read(MAX_CONFIG_BYTES + 1)
    except FileNotFoundError:
        return {}
    except NotRegularFile as exc:
        raise UserError(f"{exc}: move it away, or give the directory of another run") from None
    except OSError as exc:
        raise UserError(f"{config_path} cannot be read ({exc.strerror})") from None
    try:
        if len(text) > MAX_CONFIG_BYTES:
            raise ValueError(f"larger than {MAX_CONFIG_BYTES >> 20} MiB")
        config = yaml.load(text.decode(errors="replace"), Loader=ConfigLoader)  # bounded: depth, aliases
    except (ValueError, RecursionError, yaml.YAMLError) as exc:
        why = getattr(exc, "problem", None) or str(exc) or type(exc).__name__
        raise UserError(
            f"{config_path} does not load ({why.splitlines()[0]}): the run directory is damaged; restore it, or "
            f"leave that run out"
        ) from None
    return config if isinstance(config, dict) else {}


def expand_run_dirs(paths: list[Path]) -> tuple[list[Path], list[str]]:
    """The run directories the given paths stand for, and notes for the reader: a run directory (it has
    metrics.jsonl) is itself; a directory holding runs (a sweep's, or runs/ with runs and sweeps in it) is those runs,
    a sweep's in its sweep.json's order, without those that logged nothing yet; anything else is left for read_run
    to judge."""
    found, notes = [], []
    for path in paths:
        if not path.is_dir() or (path / METRICS_FILE).exists():
            found.append(path)
            continue
        logged, waiting = _runs_inside(path, SEARCH_DEPTH)
        found.extend(logged or [path])  # none: read_run says what is missing
        if logged and waiting:
            notes.append(f"{len(waiting)} run(s) logged nothing yet, not drawn: {', '.join(map(str, waiting))}")
    return found, notes


def _runs_inside(path: Path, depth: int) -> tuple[list[Path], list[Path]]:
    """(runs with metrics, runs without) in path and, depth - 1 levels further, in the folders that are no runs."""
    logged: list[Path] = []
    waiting: list[Path] = []
    for run_dir in run_dirs_inside(path, depth):
        (logged if _has_metrics(run_dir) else waiting).append(run_dir)
    return logged, waiting


def is_run_dir(path: Path) -> bool:
    """A run directory: one a run has started in (it holds config.yaml or metrics.jsonl)."""
    return (path / CONFIG_FILE).exists() or (path / METRICS_FILE).exists()


def run_dirs_inside(path: Path, depth: int, sweep_order: bool = True) -> list[Path]:
    """The run directories in path and, depth - 1 levels further, in the folders that are no runs: a sweep's in its
    sweep.json's order (with sweep_order), any other folder's sorted by name. An unreadable folder holds none."""
    try:
        names = (sweep_order and _sweep_order(path)) or sorted(c.name for c in path.iterdir() if c.is_dir())
    except OSError:
        return []
    found = []
    for child in (path / name for name in names):
        if is_run_dir(child):
            found.append(child)
        elif depth > 1 and child.is_dir():
            found.extend(run_dirs_inside(child, depth - 1, sweep_order))
    return found


def _sweep_order(path: Path) -> list[str]:
    try:
        return [c["name"] for c in json.loads((path / "sweep.json").read_text())["combinations"]]
    except (OSError, ValueError, KeyError, TypeError):
        return []


def _has_metrics(run_dir: Path) -> bool:
    path = run_dir / METRICS_FILE
    return path.is_file() and path.stat().st_size > 0


def group_seeds(runs: list[Run]) -> tuple[list[list[Run]], list[str]]:
    """Runs grouped by config without the per-run keys, in order of first appearance, and notes for the reader: a
    group whose seeds repeat is split into single runs (see the module docstring)."""
    groups: dict[str, list[Run]] = {}
    for run in runs:
        identity = (
            json.dumps(without_per_run_keys(run.config), sort_keys=True, default=str)
            if run.config
            else str(run.directory)
        )  # no config.yaml: a group of its own
        groups.setdefault(identity, []).append(run)
    result, notes = [], []
    for group in groups.values():
        seeds = [run.seed for run in group]
        if len(set(seeds)) == len(seeds):
            result.append(group)
        else:
            result.extend([run] for run in group)
            notes.append(
                f"{', '.join(str(run.directory) for run in group)}: the same config and seed, drawn one by "
                f"one (they differ in something config.yaml does not hold, such as the number of ranks)"
            )
    return result, notes


def curves(groups: list[list[Run]], x: str, y: str) -> list[Curve]:
    labels = _labels(groups)
    result = []
    for group, label in zip(groups, labels):
        points = [run.curve(x, y) for run in group]
        if len(points) == 1:
            result.append(Curve(label, *points[0]))
            continue
        start = max(xs[0] for xs, _ in points)
        stop = min(xs[-1] for xs, _ in points)
        grid = np.linspace(start, stop, GRID_POINTS) if stop > start else np.array([start])
        ys = np.stack([np.interp(grid, xs, values) for xs, values in points])
        result.append(Curve(f"{label} ({len(group)} seeds: mean, min-max)", grid, ys.mean(0), ys.min(0), ys.max(0)))
    return result


def draw(curves_: list[Curve], x: str, y: str, title: str, output: Path) -> None:
    import matplotlib.pyplot as plt

    figure = make_figure(curves_, x, y, title)
    # "tight" grows the picture around the axes and the legend below them: the axes keep their size with any
    # number of runs.
    try:
        figure.savefig(output, dpi=120, bbox_inches="tight", pad_inches=0.1)
    except OSError as exc:  # -o in a directory that does not exist or cannot be written
        raise UserError(
            f"cannot write {output} ({exc.strerror or exc}): give -o a file in a directory that exists and can be "
            f"written"
        ) from None
    except ValueError as exc:  # an extension matplotlib does not draw ("Format 'jpgx' is not supported (...)")
        raise UserError(f"cannot write {output}: {exc}; give -o a .png, .pdf or .svg file") from None
    finally:
        plt.close(figure)


def make_figure(curves_: list[Curve], x: str, y: str, title: str):
    """The figure: axes of a fixed size (AXES_INCHES, whatever the number of curves), the legend below them in one
    column or two, and a y label wrapped to the axes' height rather than clipped."""
    import matplotlib

    matplotlib.use("Agg")  # files only; no display needed
    import matplotlib.pyplot as plt

    colours = [matplotlib.colormaps["tab20"](i) for i in COLOUR_ORDER]
    width, height = AXES_INCHES
    figure = plt.figure(figsize=(width + 1.2, height + 1.0))
    axes = figure.add_axes((0.9 / (width + 1.2), 0.7 / (height + 1.0), width / (width + 1.2), height / (height + 1.0)))
    for index, curve in enumerate(curves_):
        marker = "o" if len(curve.x) < 20 else None  # short runs: show where the points are
        # Line styles differ too: runs that agree exactly (a layout or backend that must not change results) would
        # otherwise hide one another; with tab20's colours, 20 curves in a row look different.
        (line,) = axes.plot(
            curve.x,
            curve.mean,
            label=curve.label,
            marker=marker,
            markersize=3,
            color=colours[index % len(colours)],
            linestyle=LINE_STYLES[index % len(LINE_STYLES)],
        )
        if curve.low is not None and curve.high is not None:  # set together
            axes.fill_between(curve.x, curve.low, curve.high, color=line.get_color(), alpha=0.2, linewidth=0)
    axes.set_xlabel(LABELS.get(x, x))
    axes.set_title(title)
    axes.grid(alpha=0.3)
    renderer = cast("FigureCanvasAgg", figure.canvas).get_renderer()  # Agg: matplotlib.use above
    _set_whole_ylabel(axes, LABELS.get(y, y), renderer)
    # Below the x label (measured, in axes coordinates), never over the curves however many there are.
    label_box = axes.xaxis.get_tightbbox(renderer)
    assert label_box is not None  # the axis is drawn
    below = axes.transAxes.inverted().transform(label_box.p0)[1]
    longest = max((len(curve.label) for curve in curves_), default=0)
    columns = 2 if len(curves_) > LEGEND_ONE_COLUMN_MAX and longest <= LEGEND_TWO_COLUMN_CHARS else 1
    axes.legend(loc="upper center", bbox_to_anchor=(0.5, below - 0.02), ncols=columns, fontsize="small", frameon=False)
    return figure


def _set_whole_ylabel(axes, text: str, renderer) -> None:
    """The y label on one line if it fits the axes' height, else on two (split at the middle space)."""
    label = axes.set_ylabel(text)
    if label.get_window_extent(renderer).height <= axes.get_window_extent(renderer).height or " " not in text:
        return
    middle = len(text) // 2
    spaces = [i for i, char in enumerate(text) if char == " "]
    split = min(spaces, key=lambda i: abs(i - middle))
    axes.set_ylabel(f"{text[:split]}\n{text[split + 1 :]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m spmd_rl.plot", description=__doc__.splitlines()[0])
    parser.add_argument(
        "run_dirs", nargs="+", type=Path, metavar="RUN_DIR", help="a run directory, or one holding runs (a sweep's)"
    )
    parser.add_argument("-o", "--output", type=Path, default=Path("curves.png"), help="the picture (.png, .pdf, .svg)")
    parser.add_argument("--x", default="env_steps", help="metric on the x axis (default: env_steps)")
    parser.add_argument("--y", default="episode_return_mean", help="metric on the y axis (default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        import matplotlib  # noqa: F401  (checked before any work: the one thing to install)
    except ImportError:
        print('spmd_rl.plot needs matplotlib: pip install -e ".[plot]"', file=sys.stderr)
        return USER_ERROR_EXIT_CODE
    try:
        run_dirs, expansion_notes = expand_run_dirs(args.run_dirs)
        runs = [read_run(d) for d in run_dirs]
        groups, notes = group_seeds(runs)
        notes = expansion_notes + notes
        drawn = curves(groups, args.x, args.y)
        envs = sorted({str(run.config.get("env", {}).get("id")) for run in runs if run.config})
        draw(drawn, args.x, args.y, ", ".join(envs), args.output)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return USER_ERROR_EXIT_CODE
    for note in notes:
        print(f"note: {note}")
    print(f"{args.output}: {len(drawn)} curves from {len(runs)} runs")
    return 0


def _labels(groups: list[list[Run]]) -> list[str]:
    """A group's name (a single run: its directory's name; seeds: their run.name) followed by the config values
    that set it apart from the other curves, so that overlaid curves say what they compare."""
    flat = [flatten_config(without_per_run_keys(group[0].config)) for group in groups]
    leading, keys = distinguishing_keys(flat)
    labels = []
    for group, values, own in zip(groups, flat, keys):
        names = {run.config.get("run", {}).get("name") for run in group}
        name = group[0].directory.name if len(group) == 1 or len(names) != 1 else str(names.pop())
        text = describe_keys(values, leading, own)
        labels.append(f"{name}: {text}" if text else name)
    return labels


def distinguishing_keys(configs: list[dict]) -> tuple[list[str], list[list[str]]]:
    """(leading, keys): the keys that set each flat config (dotted keys) apart from the others, in config order.

    Leading: what makes it another experiment (EXPERIMENT_KEYS: the env, the algorithm, the policy), where those
    differ among the configs. Keys, for each config: among the configs of the same experiment, each key where this
    one is not the usual value: a value most of them share (by more than any other, and by two or more) is left out
    for those that hold it, so that a run that changed one key from the rest shows that key, not the keys every
    run shares.
    Without a usual value (a sweep's grid: every value held equally), every holder shows its value. A key a config
    lacks (a plug-in's own knob, a key left out at its default) is never shown for it: 'key=None' says nothing."""
    absent = object()
    keys = list(dict.fromkeys(k for config in configs for k in config))  # config order: a section's keys together
    leading = [k for k in EXPERIMENT_KEYS if len({_text(c[k]) for c in configs if k in c}) > 1]
    experiments: dict[str, list[int]] = {}
    for index, config in enumerate(configs):
        experiments.setdefault(_text([config.get(k, absent) for k in leading]), []).append(index)
    shown: list[set[str]] = [set() for _ in configs]
    for members in experiments.values():
        for key in keys:
            if key in leading:
                continue
            values = [_text(configs[i].get(key, absent)) for i in members]
            counts = sorted(((values.count(v), v) for v in set(values)), reverse=True)
            if len(counts) == 1:
                continue  # the same in the whole experiment
            usual = counts[0][1] if counts[0][0] >= 2 and counts[0][0] > counts[1][0] else None
            for i, value in zip(members, values):
                if value != usual:
                    shown[i].add(key)
    return leading, [[k for k in keys if k in chosen and k in config] for config, chosen in zip(configs, shown)]


def _text(value) -> str:
    return json.dumps(value, sort_keys=True, default=lambda v: f"<{id(v)}>")


def describe_keys(flat: dict, leading: list[str], keys: list[str], limit: int = LABEL_DETAIL_CHARS) -> str:
    """'CartPole-v1 ppo; algo.learning_rate=0.001 num_steps=64': the leading keys' values alone (the module of a
    plug-in's or env factory's module:name left out), then the keys, a section named once for its keys in a row;
    whole items only (a cut value would say something wrong), ' ...' past `limit` characters."""
    text = " ".join(str(flat[k]).rpartition(":")[2] for k in leading if k in flat)
    section, separator = None, "; " if text else ""
    for key in keys:
        head, _, tail = key.rpartition(".")
        item = f"{tail if head == section else key}={flat.get(key)}"
        section = head
        if len(text) + len(item) > limit:
            return f"{text} ..."
        text, separator = f"{text}{separator}{item}", " "
    return text


def without_per_run_keys(config: dict) -> dict:
    config = {section: dict(values) if isinstance(values, dict) else values for section, values in config.items()}
    for section, key in _PER_RUN_KEYS:
        if isinstance(config.get(section), dict):
            config[section].pop(key, None)
    return config


def flatten_config(config: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat.update(flatten_config(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and np.isfinite(value)


if __name__ == "__main__":
    sys.exit(main())
