"""Learning curves from run directories: `python -m spmd_rl.plot RUN_DIR [RUN_DIR ...] -o curves.png`.

Each run's metrics.jsonl gives one curve (--y against --x). Runs whose config.yaml differ only in train.seed (and
run.dir / run.name) are seeds of one experiment: they are drawn as one curve, the mean over seeds with the min-max
spread shaded, on a common x grid over the range every seed reached. Runs with the same config and the same seed
are not seeds of one experiment (they differ in something config.yaml does not hold, such as the number of ranks)
and are drawn one by one.

A directory that is no run but holds runs (a sweep's directory from `python -m spmd_rl.sweep`, or runs/) stands for
the runs in it: a sweep's in the order of its sweep.json, skipping (with a note) those that logged nothing yet.

matplotlib is an optional extra: pip install -e ".[plot]".
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml

from spmd_rl.persist.run_files import CONFIG_FILE, METRICS_FILE
from spmd_rl.runtime.errors import USER_ERROR_EXIT_CODE, UserError

# What a curve's identity ignores when grouping seeds.
_PER_RUN_KEYS = (("train", "seed"), ("run", "dir"), ("run", "name"))
GRID_POINTS = 200
SEARCH_DEPTH = 3  # how deep a directory of runs is searched: runs/<sweep>/<run>
LABEL_DETAIL_CHARS = 70
LINE_STYLES = ("-", "--", ":", "-.")
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
    if not path.is_file():
        raise UserError(f"{run_dir} has no metrics.jsonl: give the directory of a run (its run.dir)")
    lines = path.read_text(errors="replace").splitlines()  # bytes that are not UTF-8: a damaged line, named below
    by_iteration: dict = {}
    for number, line in enumerate(lines, start=1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):
                break  # torn by a kill during the write
            raise UserError(f"{path}:{number} is not a JSON line: the file is damaged; remove that line") from None
        by_iteration[record.get("iteration", number)] = record
    if not by_iteration:
        raise UserError(f"{path} is empty: the run logged no iteration yet")
    return [by_iteration[k] for k in sorted(by_iteration)]


def read_run(run_dir: Path) -> Run:
    if not run_dir.is_dir():
        raise UserError(f"run directory {run_dir} does not exist")
    records = read_metrics(run_dir)
    config_path = run_dir / CONFIG_FILE
    try:
        config = yaml.safe_load(config_path.read_text()) if config_path.is_file() else {}
    except yaml.YAMLError:
        raise UserError(f"{config_path} is not valid YAML: the run directory is damaged") from None
    return Run(run_dir, config if isinstance(config, dict) else {}, records)


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
    logged, waiting = [], []
    names = _sweep_order(path) or sorted(child.name for child in path.iterdir() if child.is_dir())
    for child in (path / name for name in names):
        if (child / CONFIG_FILE).exists() or (child / METRICS_FILE).exists():
            (logged if _has_metrics(child) else waiting).append(child)
        elif depth > 1 and child.is_dir():
            more_logged, more_waiting = _runs_inside(child, depth - 1)
            logged += more_logged
            waiting += more_waiting
    return logged, waiting


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
            json.dumps(_without_per_run_keys(run.config), sort_keys=True, default=str)
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
    import matplotlib

    matplotlib.use("Agg")  # files only; no display needed
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 5), layout="constrained")
    for index, curve in enumerate(curves_):
        marker = "o" if len(curve.x) < 20 else None  # short runs: show where the points are
        # Line styles differ too: runs that agree exactly (a layout or backend that must not change results) would
        # otherwise hide one another.
        (line,) = axes.plot(
            curve.x,
            curve.mean,
            label=curve.label,
            marker=marker,
            markersize=3,
            linestyle=LINE_STYLES[index % len(LINE_STYLES)],
        )
        if curve.low is not None:
            axes.fill_between(curve.x, curve.low, curve.high, color=line.get_color(), alpha=0.2, linewidth=0)
    axes.set_xlabel(LABELS.get(x, x))
    axes.set_ylabel(LABELS.get(y, y))
    axes.set_title(title)
    axes.grid(alpha=0.3)
    figure.legend(loc="outside lower center", fontsize="small")  # below the axes: it never covers a curve
    figure.savefig(output, dpi=120)
    plt.close(figure)


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
    flat = [_flatten(_without_per_run_keys(group[0].config)) for group in groups]
    keys = list(dict.fromkeys(k for f in flat for k in f))  # config order: a section's keys stay together
    differing = [k for k in keys if any(f.get(k) != other.get(k) for f in flat for other in flat)]
    labels = []
    for group, values in zip(groups, flat):
        names = {run.config.get("run", {}).get("name") for run in group}
        name = group[0].directory.name if len(group) == 1 or len(names) != 1 else str(names.pop())
        shown, section = [], None
        for key in differing:
            head, _, tail = key.rpartition(".")
            shown.append(f"{tail if head == section else key}={values.get(key)}")
            section = head
        text = ""
        for item in shown:  # whole items only: a cut value would say something wrong
            if len(text) + len(item) > LABEL_DETAIL_CHARS:
                text += " ..."
                break
            text = f"{text} {item}" if text else item
        labels.append(f"{name}: {text}" if text else name)
    return labels


def _without_per_run_keys(config: dict) -> dict:
    config = {section: dict(values) if isinstance(values, dict) else values for section, values in config.items()}
    for section, key in _PER_RUN_KEYS:
        if isinstance(config.get(section), dict):
            config[section].pop(key, None)
    return config


def _flatten(config: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and np.isfinite(value)


if __name__ == "__main__":
    sys.exit(main())
