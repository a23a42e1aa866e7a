"""python -m spmd_rl.sweep: the value lists (top-level commas only), the cartesian product and its run directories,
bad input as exit 2 and one line before any run, a real sweep of the tiny config (2 seeds x 2 learning rates) that
stops, is rerun and resumes, is rerun again and skips, and is drawn by spmd_rl.plot as one curve per learning rate;
a failing run that does not stop the others and a signal passed on to the running run (a stand-in launcher); the
Slurm job array's script and the mapping of SLURM_ARRAY_TASK_ID to a combination (and, marked slow, a real array on
a throw-away Slurm cluster)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from spmd_rl import plot
from spmd_rl.config.loading import load_config
from spmd_rl.sweep import combinations, main, parse_overrides, split_values

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs" / "ci_tiny.yaml")
GRID = ["train.seed=1,2", "algo.learning_rate=3e-4,1e-3"]
NAMES = [
    "seed=1,learning_rate=3e-4",
    "seed=1,learning_rate=1e-3",
    "seed=2,learning_rate=3e-4",
    "seed=2,learning_rate=1e-3",
]


def sweep(*args: str, cwd: Path, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "spmd_rl.sweep", *args],
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def sweep_dir(root: Path) -> Path:
    (found,) = root.glob("runs/sweep-*")
    return found


@pytest.mark.parametrize(
    ("text", "values"),
    [
        ("3e-4", ["3e-4"]),
        ("1,2,3", ["1", "2", "3"]),
        ("[64,64],[32,32]", ["[64,64]", "[32,32]"]),
        ("[64, 64]", ["[64, 64]"]),
        ("{a: 1, b: [2, 3]},{a: 2}", ["{a: 1, b: [2, 3]}", "{a: 2}"]),
        ("'a,b',c", ["'a,b'", "c"]),
        ('"x,\\"y,z",w', ['"x,\\"y,z"', "w"]),
        ("it's,fine", ["it's", "fine"]),  # an apostrophe inside a word starts no quoted string
        ("[1,2]],3", ["[1,2]]", "3"]),  # unbalanced: split where it can, the config check judges the value
    ],
)
def test_only_top_level_commas_split_a_value_list(text, values):
    assert split_values(text) == values


def test_the_product_varies_the_first_key_slowest_and_names_each_run_by_its_values():
    common, swept = parse_overrides(["train.total_steps=64", *GRID, "policy.hidden_sizes=[64,64],[8]"])
    assert common == ["train.total_steps=64"]
    combos = combinations(swept)
    assert len(combos) == 8
    assert [c.name for c in combos[:2]] == [
        "seed=1,learning_rate=3e-4,hidden_sizes=[64,64]",
        "seed=1,learning_rate=3e-4,hidden_sizes=[8]",
    ]
    assert combos[-1].overrides == ["train.seed=2", "algo.learning_rate=1e-3", "policy.hidden_sizes=[8]"]
    # the same key name in two sections: the whole key; a '/' in a value does not make a subdirectory
    named = combinations(parse_overrides(["algo.seed=1,2", "train.seed=3,4", "env.id=ALE/Pong-v5,CartPole-v1"])[1])
    assert named[0].name == "algo.seed=1,train.seed=3,id=ALE_Pong-v5"
    assert combinations([]) and combinations([])[0].name == "run"  # no list at all: one run


def test_bad_input_is_exit_2_and_one_line_before_any_run(tmp_path, capsys):
    cases = [
        (["algo.learning_rat=3e-4,1e-3"], "learning_rat"),  # an unknown key
        (["algo.learning_rate=3e-4,fast"], "combination learning_rate=fast:"),  # a bad value in one combination
        (["train.seed=1,,2"], "empty value"),
        (["train.seed=1,2,1"], "more than once"),
        (["train.seed=1,2", "train.seed=3"], "set twice"),
        (["train.seed=1,2", "run.dir=x"], "drop run.dir"),
        (["train.seed=1,2", "--launcher", "no-such-launcher -x"], "not found on PATH"),
    ]
    for args, expected in cases:
        assert main(["--config", TINY, "--root", str(tmp_path / "runs"), *args]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("spmd_rl.sweep: error: ") and expected in err, (args, err)
    assert not (tmp_path / "runs").exists()  # nothing ran, nothing was written


def test_a_sweep_directory_that_cannot_be_made_is_exit_2_and_one_line(tmp_path, capsys):
    # fault pass 9, SW1: --dir under /proc (or under a file) was an OSError traceback from mkdir, exit 1
    (tmp_path / "file").write_text("")
    for where in (["--dir", str(tmp_path / "file" / "sweep")], ["--root", str(tmp_path / "file")]):
        assert main(["--config", TINY, *where, "train.seed=1,2"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "cannot create the directory" in err, err


def test_help_and_bad_input_answer_without_importing_torch(tmp_path):
    probe = (
        "import sys; from spmd_rl.sweep import main; code = main(['algo.nope=1,2']); "
        "print(code, 'torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == ["2", "False"], done.stderr
    assert "comma lists sweep" in sweep("--help", cwd=tmp_path).stdout


@pytest.mark.slow  # six real runs of the tiny config (87-105 s measured on a 2-core machine at load 9)
def test_a_real_sweep_stops_resumes_on_a_rerun_skips_finished_runs_and_plots_one_curve_per_rate(tmp_path):
    # 6 real runs in all. The first pass's launcher stops seed 2's runs halfway (8 iterations, a checkpoint after 4)
    # as a signal would; the rerun (the same command, the default launcher) skips seed 1's finished runs and resumes
    # seed 2's; once more, everything is skipped.
    launcher = tmp_path / "stopping_python.sh"
    launcher.write_text(
        f'#!/bin/sh\ncase " $* " in *" train.seed=2 "*) exec {sys.executable} "$@" run.stop_after_iterations=4;; esac\n'
        f'exec {sys.executable} "$@"\n'
    )
    launcher.chmod(0o755)
    command = ["--config", TINY, *GRID]
    first = sweep("--launcher", str(launcher), *command, cwd=tmp_path)
    assert first.returncode == 75, first.stdout + first.stderr
    assert first.stderr.strip() == (
        "spmd_rl.sweep: 2 stopped with a checkpoint (seed=2,learning_rate=3e-4, seed=2,learning_rate=1e-3; rerun "
        "to resume); 2 done, 0 skipped (finished earlier)"
    )
    directory = sweep_dir(tmp_path)
    assert [c["name"] for c in json.loads((directory / "sweep.json").read_text())["combinations"]] == NAMES
    for name in NAMES[2:]:
        assert (directory / name / "checkpoints" / "iter_000000003").is_dir()
        assert not (directory / name / "finished.json").exists()

    second = sweep(*command, cwd=tmp_path)
    assert second.returncode == 0, second.stdout + second.stderr
    assert second.stdout.count("finished earlier, skipped") == 2
    for name in NAMES:
        log = (directory / name / "sweep.log").read_text()
        assert log.count("==== ") == (2 if name in NAMES[2:] else 1)
        assert ("resuming from" in log) == (name in NAMES[2:])
        assert [r["iteration"] for r in plot.read_metrics(directory / name)] == list(range(8))
        assert (directory / name / "finished.json").exists()
    assert f"curves: python -m spmd_rl.plot {directory.relative_to(tmp_path)} -o " in second.stdout

    clock = time.monotonic()
    third = sweep(*command, cwd=tmp_path)
    assert third.returncode == 0 and third.stdout.count("finished earlier, skipped") == 4, third.stdout
    assert time.monotonic() - clock < 20  # no run was started

    assert plot.main([str(directory), "-o", str(tmp_path / "curves.png")]) == 0
    runs = [plot.read_run(path) for path in plot.expand_run_dirs([directory])[0]]
    groups, _ = plot.group_seeds(runs)
    assert [[run.directory.name for run in group] for group in groups] == [[NAMES[0], NAMES[2]], [NAMES[1], NAMES[3]]]
    assert (tmp_path / "curves.png").stat().st_size > 0


# A stand-in for `python`: seed 2 fails, seed 5 waits for a signal (and stops as a run does: exit 75), others pass.
STAND_IN = """#!/bin/sh
for arg; do case $arg in run.dir=*) dir=${arg#run.dir=};; train.seed=*) seed=${arg#train.seed=};; esac; done
echo "args: $*"
case $seed in
  2) echo "error: something broke in seed 2" >&2; exit 4;;
  5) trap 'echo INT >> "$dir/signals"; exit 75' INT; touch "$dir/waiting"; while :; do sleep 0.05; done;;
esac
"""


def stand_in(tmp_path: Path) -> str:
    path = tmp_path / "stand_in.sh"
    path.write_text(STAND_IN)
    path.chmod(0o755)
    return str(path)


def test_a_failing_run_does_not_stop_the_others_and_the_summary_names_it_and_its_log(tmp_path):
    done = sweep("--launcher", stand_in(tmp_path), "--config", TINY, "train.seed=1,2,3", cwd=tmp_path)
    assert done.returncode == 1
    directory = sweep_dir(tmp_path)
    summary = done.stderr.strip()
    assert "\n" not in summary and "1 of 3 failed: seed=2 (exit 4; " in summary
    assert f"{directory.relative_to(tmp_path) / 'seed=2' / 'sweep.log'})" in summary
    assert "something broke in seed 2" in (directory / "seed=2" / "sweep.log").read_text()
    assert "[2/3] seed=2: failed with exit 4" in done.stdout and "[3/3] seed=3: done" in done.stdout
    args = (directory / "seed=3" / "sweep.log").read_text()  # the launcher got what spmd_rl.main takes
    assert (
        f"args: -m spmd_rl.main --config {TINY} run.dir={directory.relative_to(tmp_path) / 'seed=3'} train.seed=3"
        in args
    )


def test_a_signal_to_the_sweep_reaches_the_running_run_once_and_stops_the_sweep(tmp_path):
    args = [sys.executable, "-m", "spmd_rl.sweep", "--launcher", stand_in(tmp_path), "--config", TINY]
    proc = subprocess.Popen(
        [*args, "train.seed=1,5,6"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 30
    while not list(tmp_path.glob("runs/sweep-*/seed=5/waiting")):
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)  # a hang's bound (a signal lost once: _Signals.started)
    assert proc.returncode == 75, out + err
    directory = sweep_dir(tmp_path)
    assert (directory / "seed=5" / "signals").read_text() == "INT\n"
    assert err.strip().endswith(
        "stopped by SIGINT during seed=5; rerun the same command to resume (finished runs are skipped)"
    )
    assert not (directory / "seed=6").exists()


def test_slurm_array_script_and_each_task_runs_its_combination(tmp_path):
    # A stand-in for slurm/train.sh: its #SBATCH lines are copied (job name, output replaced); it records its args.
    script = tmp_path / "slurm" / "train.sh"
    script.parent.mkdir()
    (script.parent / "common.sh").write_text("")
    script.write_text(
        "#!/usr/bin/env bash\n#SBATCH --job-name=mine\n#SBATCH --time=00:10:00\n#SBATCH --output=x-%j.out\n"
        f'printf "%s\\n" "$SPMD_RL_HOME" "$@" > "{tmp_path}/$SLURM_ARRAY_TASK_ID.args"\n'
    )
    root = tmp_path / "runs"
    code = main(["--slurm", "--no-submit", "--slurm-script", str(script), "--root", str(root), "--config", TINY, *GRID])
    assert code == 0
    directory = sweep_dir(tmp_path)
    text = (directory / "sweep.sbatch").read_text()
    assert "#SBATCH --array=0-3\n" in text and "#SBATCH --time=00:10:00\n" in text
    assert f"#SBATCH --job-name={directory.name}\n" in text and "mine" not in text and "x-%j" not in text
    assert f"#SBATCH --output={directory.resolve()}/slurm-%A_%a.out\n" in text
    for index, name in enumerate(NAMES):  # the generated script, as Slurm would start task `index`
        done = subprocess.run(
            ["bash", str(directory / "sweep.sbatch")],
            cwd=tmp_path,
            env={**os.environ, "PYTHONPATH": str(REPO), "SLURM_ARRAY_TASK_ID": str(index)},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        assert f"combination {index} of 0..3: {name}" in done.stdout
        recorded = (tmp_path / f"{index}.args").read_text().splitlines()
        seed, rate = name.split(",")
        assert recorded == [
            str(tmp_path),  # SPMD_RL_HOME: where the script's slurm/ folder is
            TINY,
            f"run.dir={directory.resolve() / name}",
            f"train.{seed}",
            f"algo.{rate}",
        ]
    # a finished run of this combination (its config.yaml, finished.json): the task has nothing to do
    (tmp_path / "1.args").unlink()
    (directory / NAMES[1]).mkdir()
    (directory / NAMES[1] / "config.yaml").write_text(
        load_config(TINY, ["train.seed=1", "algo.learning_rate=1e-3"]).to_yaml()
    )
    (directory / NAMES[1] / "finished.json").write_text("{}")
    for task, expected in (
        ("1", f"combination 1 ({NAMES[1]}) finished earlier; nothing to do"),
        ("9", "is not one of the 4"),
        (None, "SLURM_ARRAY_TASK_ID, which is not set"),
    ):
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        env.pop("SLURM_ARRAY_TASK_ID", None)
        if task is not None:
            env["SLURM_ARRAY_TASK_ID"] = task
        done = subprocess.run(
            [sys.executable, "-m", "spmd_rl.sweep", "--task", str(directory)], env=env, capture_output=True, text=True
        )
        if task == "1":
            assert done.returncode == 0 and expected in done.stdout and not (tmp_path / "1.args").exists()
        else:
            assert done.returncode == 2 and expected in done.stderr and done.stderr.count("\n") == 1, done.stderr

    # with the real slurm/train.sh: its directives (the time-limit signal, requeue) come along
    assert main(["--slurm", "--no-submit", "--root", str(tmp_path / "real"), "--config", TINY, "train.seed=1,2"]) == 0
    (real,) = (tmp_path / "real").glob("sweep-*")
    text = (real / "sweep.sbatch").read_text()
    assert "#SBATCH --signal=B:USR1@120" in text and "#SBATCH --requeue" in text and "#SBATCH --array=0-1\n" in text
    assert f"export SPMD_RL_HOME=${{SPMD_RL_HOME:-{REPO}}}" in text


@pytest.mark.slow
def test_a_real_slurm_job_array_trains_each_combination(tmp_path_factory, tmp_path):
    from harness.slurm_cluster import slurm_cluster_fixture

    fixture = slurm_cluster_fixture(tmp_path_factory, node_count=1)
    cluster = next(fixture)
    try:
        env = {**cluster.env, "PYTHON": sys.executable, "GLOO_SOCKET_IFNAME": "lo", "RANKS_PER_NODE": "1"}
        done = sweep("--slurm", "--config", TINY, "train.seed=1,2", cwd=tmp_path, env=env)
        assert done.returncode == 0, done.stderr
        job = done.stdout.split("submitted job array ")[1].split()[0]
        result = cluster.wait_job(job, timeout=300)
        directory = sweep_dir(tmp_path)
        for index, name in enumerate(["seed=1", "seed=2"]):
            output = (directory / f"slurm-{job}_{index}.out").read_text()
            assert (directory / name / "finished.json").exists(), output
            assert f"combination {index} of 0..1: {name}" in output
        assert result.state == "COMPLETED", result
    finally:
        next(fixture, None)


def test_plot_finds_the_runs_in_a_sweep_directory_or_in_runs(tmp_path):
    directory = tmp_path / "runs" / "sweep-x-12345678"
    names = ["seed=2", "seed=1", "seed=3"]  # sweep.json's order wins over the names' order
    for name in names:
        (directory / name).mkdir(parents=True)
        (directory / name / "config.yaml").write_text(yaml.safe_dump({"train": {"seed": int(name[-1])}}))
    for name in names[:2]:
        (directory / name / "metrics.jsonl").write_text('{"iteration": 0, "env_steps": 1, "episode_return_mean": 1}\n')
    (directory / "sweep.json").write_text(json.dumps({"combinations": [{"name": name} for name in names]}))
    single = tmp_path / "runs" / "single"
    single.mkdir()
    (single / "metrics.jsonl").write_text('{"iteration": 0, "env_steps": 1, "episode_return_mean": 1}\n')
    found, notes = plot.expand_run_dirs([directory])
    assert found == [directory / "seed=2", directory / "seed=1"]
    assert notes == [f"1 run(s) logged nothing yet, not drawn: {directory / 'seed=3'}"]
    assert plot.expand_run_dirs([tmp_path / "runs"])[0] == [single, directory / "seed=2", directory / "seed=1"]
    assert plot.expand_run_dirs([single]) == ([single], [])
