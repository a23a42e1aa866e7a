"""python -m spmd_rl.plot of a runs/ directory with 15 runs, as issue 27 found it: a legend that squeezed the axes,
a clipped y label, and labels listing keys every run shares while hiding, behind '...', the one that differs.
The configs are the framework's own (load_config(...).to_dict(), what config.yaml holds), PPO and SAC together."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml

from spmd_rl.config import load_config
from spmd_rl.plot import curves, expand_run_dirs, group_seeds, make_figure, read_run

ROOT = Path(__file__).resolve().parents[2]

# (config file, changed keys): 15 runs, three of them seeds of one experiment
RUNS = [
    ("ppo_cartpole", {}),
    ("ppo_cartpole", {"train.seed": 2}),
    ("ppo_cartpole", {"train.seed": 3}),
    *[("ppo_cartpole", {"algo.learning_rate": lr}) for lr in (0.0003, 0.003, 0.01)],
    *[("ppo_cartpole", {"algo.update_epochs": n}) for n in (4, 10)],
    ("ppo_cartpole", {"env.num_envs": 16}),
    ("ppo_cartpole", {"run.stop_at_return": 400.0}),  # a key config.yaml holds only when set
    ("ppo_cartpole", {"policy.hidden_sizes": [128, 128]}),
    ("ppo_pendulum", {}),
    ("sac_pendulum", {}),
    ("sac_pendulum", {"algo.tau": 0.01}),
    ("ppo_cartpole", {"env.id": "my_envs.factories:masked_cartpole"}),  # an env factory
]


def write_runs(root: Path) -> list[Path]:
    dirs = []
    loaded = {name: load_config(ROOT / "configs" / f"{name}.yaml").to_dict() for name, _ in RUNS}
    for index, (name, changes) in enumerate(RUNS):
        config = copy.deepcopy(loaded[name])
        for key, value in changes.items():
            section, _, tail = key.partition(".")
            config[section][tail] = value
        run_dir = root / f"{config['run']['name']}-{index:08x}"  # as runs/<name>-<digest>
        run_dir.mkdir()
        config["run"]["dir"] = str(run_dir)
        (run_dir / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        lines = [
            json.dumps({"iteration": i, "env_steps": 1000 * (i + 1), "episode_return_mean": 10.0 * i + index})
            for i in range(30)
        ]
        (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
        dirs.append(run_dir)
    return dirs


def drawn(root: Path):
    run_dirs, _ = expand_run_dirs([root])
    groups, notes = group_seeds([read_run(d) for d in run_dirs])
    return curves(groups, "env_steps", "episode_return_mean")


def test_labels_show_only_the_keys_that_differ_whole(tmp_path):
    write_runs(tmp_path)
    labels = [curve.label for curve in drawn(tmp_path)]
    assert len(labels) == 13  # the three seeds are one curve
    assert not any(label.endswith("...") for label in labels), labels
    by_name = dict(label.split(": ", 1) if ": " in label else (label, "") for label in labels)
    # each single change is in its run's label, and only that change beside what tells the experiments apart
    assert "algo.learning_rate=0.003" in by_name["ppo_cartpole-00000004"]
    assert "algo.update_epochs=4" in by_name["ppo_cartpole-00000006"]
    assert "env.num_envs=16" in by_name["ppo_cartpole-00000008"]
    assert "run.stop_at_return=400" in by_name["ppo_cartpole-00000009"]
    assert "policy.hidden_sizes=[128, 128]" in by_name["ppo_cartpole-0000000a"]
    assert "algo.tau=0.01" in by_name["sac_pendulum-0000000d"]
    assert by_name["ppo_cartpole-0000000e"] == "masked_cartpole ppo actor_critic"  # the factory's module left out
    for label in labels:
        assert "=None" not in label  # a key a run does not have is not shown for it
        assert "log." not in label and "dist." not in label and "checkpoint." not in label  # shared by all
    # PPO-only keys (clip_coef) are implied by algo.class, not spelled out for every PPO run
    assert not any("clip_coef" in label for label in labels)
    assert labels[0] == "ppo_cartpole: CartPole-v1 ppo actor_critic (3 seeds: mean, min-max)"  # the usual values
    assert by_name["ppo_cartpole-00000004"] == "CartPole-v1 ppo actor_critic; algo.learning_rate=0.003"
    assert by_name["sac_pendulum-0000000d"] == "Pendulum-v1 sac squashed_gaussian; algo.tau=0.01"


def _boxes(figure):
    figure.canvas.draw()
    renderer = figure.canvas.get_renderer()
    axes = figure.axes[0]
    return renderer, axes, axes.get_window_extent(renderer), axes.get_legend().get_window_extent(renderer)


def test_the_legend_goes_below_the_axes_without_squeezing_them_and_the_y_label_is_whole(tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    dirs = write_runs(tmp_path)
    many = make_figure(drawn(tmp_path), "env_steps", "episode_return_mean", "CartPole-v1, Pendulum-v1")
    single_root = tmp_path / "one"
    single_root.mkdir()
    dirs[0].rename(single_root / dirs[0].name)
    one = make_figure(drawn(single_root), "env_steps", "episode_return_mean", "CartPole-v1")
    renderer, axes, axes_box, legend_box = _boxes(many)
    _, _, one_axes_box, _ = _boxes(one)
    assert (axes_box.width, axes_box.height) == (one_axes_box.width, one_axes_box.height)  # not squeezed
    assert legend_box.y1 < axes.xaxis.get_tightbbox(renderer).y0  # below the axes and their x label
    label = axes.yaxis.label
    assert label.get_text().replace("\n", " ") == "episode return (mean of the last 20 episodes)"
    assert label.get_window_extent(renderer).height <= axes_box.height  # whole, beside the axes
    assert len(axes.get_legend().get_texts()) == 13
    plt.close(many)
    plt.close(one)


def test_the_picture_holds_the_whole_legend(tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib.image

    from spmd_rl.plot import main

    write_runs(tmp_path)
    output = tmp_path / "curves.png"
    assert main([str(tmp_path), "-o", str(output)]) == 0
    height, width, _ = matplotlib.image.imread(output).shape
    assert height > 4.5 * 120 + 13 * 10  # the axes' 4.5 inches at 120 dpi, and room for 13 legend lines
