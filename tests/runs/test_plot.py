"""python -m spmd_rl.plot: reading metrics (torn last line, repeated iterations), grouping seeds, the curves' mean
and spread, the picture, and the one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from spmd_rl.plot import curves, group_seeds, main, read_metrics, read_run
from spmd_rl.runtime.errors import UserError


def make_run(
    root: Path,
    name: str,
    seed: int,
    returns: list[float],
    steps_per_iteration: int = 100,
    learning_rate: float = 0.001,
    torn_tail: bool = False,
) -> Path:
    run_dir = root / name
    run_dir.mkdir()
    config = {
        "run": {"name": "ppo_cartpole", "dir": str(run_dir)},
        "env": {"id": "CartPole-v1", "num_envs": 8},
        "algo": {"name": "ppo", "learning_rate": learning_rate},
        "train": {"seed": seed, "total_steps": 1000},
    }
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    lines = [
        json.dumps({"iteration": i, "env_steps": (i + 1) * steps_per_iteration, "episode_return_mean": value})
        for i, value in enumerate(returns)
    ]
    text = "\n".join(lines) + "\n"
    if torn_tail:
        text += '{"iteration": 99, "env_st'
    (run_dir / "metrics.jsonl").write_text(text)
    return run_dir


def test_read_metrics_skips_a_torn_last_line_and_keeps_the_last_of_repeated_iterations(tmp_path):
    run_dir = make_run(tmp_path, "a", 1, [1.0, 2.0, 3.0], torn_tail=True)
    assert [r["episode_return_mean"] for r in read_metrics(run_dir)] == [1.0, 2.0, 3.0]
    run_dir = make_run(tmp_path, "b", 1, [1.0, 2.0, 3.0])
    with open(run_dir / "metrics.jsonl", "a") as f:  # a resume that repeated iterations 1 and 2
        f.write('{"iteration": 1, "env_steps": 200, "episode_return_mean": 20.0}\n')
        f.write('{"iteration": 2, "env_steps": 300, "episode_return_mean": 30.0}\n')
    assert [r["episode_return_mean"] for r in read_metrics(run_dir)] == [1.0, 20.0, 30.0]


def test_a_damaged_line_before_the_last_is_a_user_error_naming_it(tmp_path):
    run_dir = make_run(tmp_path, "a", 1, [1.0, 2.0])
    text = (run_dir / "metrics.jsonl").read_text()
    (run_dir / "metrics.jsonl").write_text("garbage\n" + text)
    with pytest.raises(UserError, match="metrics.jsonl:1 "):
        read_metrics(run_dir)


def test_seeds_of_one_config_are_one_curve_of_mean_and_spread(tmp_path):
    # Seeds logging at different steps: the mean is taken on a common grid over the range all of them reached.
    seeds = [
        make_run(tmp_path, f"s{seed}", seed, [float(seed * v) for v in range(1, 11)], steps_per_iteration=step)
        for seed, step in ((1, 100), (2, 100), (3, 50))
    ]
    other = make_run(tmp_path, "lr", 1, [5.0] * 10, learning_rate=0.0003)
    groups, notes = group_seeds([read_run(d) for d in (*seeds, other)])
    assert [[run.directory.name for run in group] for group in groups] == [["s1", "s2", "s3"], ["lr"]]
    assert notes == []
    grouped, single = curves(groups, "env_steps", "episode_return_mean")
    assert grouped.x[0] == 100 and grouped.x[-1] == 500  # s3 stops at 10 x 50 steps
    # at env step x, seed s has returned s * x / step
    expected = np.stack([s * grouped.x / step for s, step in ((1, 100), (2, 100), (3, 50))])
    np.testing.assert_allclose(grouped.mean, expected.mean(0))
    np.testing.assert_allclose(grouped.low, expected.min(0))
    np.testing.assert_allclose(grouped.high, expected.max(0))
    assert grouped.label == "ppo_cartpole: algo.learning_rate=0.001 (3 seeds: mean, min-max)"
    assert single.label == "lr: algo.learning_rate=0.0003" and single.low is None


def test_runs_with_the_same_config_and_seed_are_drawn_one_by_one(tmp_path):
    runs = [read_run(make_run(tmp_path, name, 1, [1.0, 2.0])) for name in ("one_rank", "two_ranks")]
    groups, notes = group_seeds(runs)
    assert [len(group) for group in groups] == [1, 1]
    assert "one_rank" in notes[0] and "two_ranks" in notes[0]


def test_the_command_draws_a_picture(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    run_dirs = [make_run(tmp_path, f"s{seed}", seed, list(np.linspace(10, 400, 30) + seed)) for seed in (1, 2)]
    output = tmp_path / "curves.png"
    assert main([*map(str, run_dirs), "-o", str(output)]) == 0
    assert output.read_bytes().startswith(b"\x89PNG")
    assert "1 curves from 2 runs" in capsys.readouterr().out
    import matplotlib.image

    height, width, _ = matplotlib.image.imread(output).shape
    assert width > 400 and height > 300


@pytest.mark.parametrize("problem", ["missing_dir", "no_metrics", "metrics_fifo", "unknown_metric"])
def test_bad_input_exits_2_with_one_line(tmp_path, capsys, problem):
    pytest.importorskip("matplotlib")
    run_dir = make_run(tmp_path, "a", 1, [1.0, 2.0])
    args = [str(run_dir), "-o", str(tmp_path / "c.png")]
    if problem == "missing_dir":
        args[0] = str(tmp_path / "nowhere")
    elif problem == "no_metrics":
        (run_dir / "metrics.jsonl").unlink()
    elif problem == "metrics_fifo":  # named as what it is, not as missing (pass 4, M3)
        (run_dir / "metrics.jsonl").unlink()
        os.mkfifo(run_dir / "metrics.jsonl")
    else:
        args += ["--y", "eval_return_mean"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and (args[0] in err)
    if problem == "unknown_metric":
        assert "episode_return_mean" in err  # the choices
    if problem == "metrics_fifo":
        assert "metrics.jsonl is not a regular file" in err, err


def test_without_matplotlib_it_says_what_to_install(tmp_path):
    run_dir = make_run(tmp_path, "a", 1, [1.0, 2.0])
    hide = "import sys; sys.modules['matplotlib'] = None; from spmd_rl.plot import main; sys.exit(main(sys.argv[1:]))"
    done = subprocess.run(
        [sys.executable, "-c", hide, str(run_dir), "-o", str(tmp_path / "c.png")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stderr.strip() == 'spmd_rl.plot needs matplotlib: pip install -e ".[plot]"'
