"""Env groups (env.groups): several env settings in one run, every env rank hosting every group; their checks
before start, per-group episode statistics and evaluation (eval.env), the experience files' group column, a split
layout, and exact resume."""

import json
import shutil
import subprocess
import sys

import h5py
import pytest
import torch
import torch.distributed as dist
import yaml
from harness.launch import ROOT
from harness.launch import job_env as _env
from harness.multiproc import assert_all_ok, run_ranks
from harness.runs import TINY, assert_same_run, run_main
from tensordict import TensorDict

from spmd_rl.algorithms.ppo import PPO
from spmd_rl.config.loading import evaluation_env, load_config
from spmd_rl.envs.vector import check_same_spaces, probe_env
from spmd_rl.experience import summarize
from spmd_rl.roles.trainer import Trainer
from spmd_rl.run.plan import plan_run
from spmd_rl.run.topology import build_topology
from spmd_rl.runtime.errors import UserError
from spmd_rl.sweep import plan_sweep

POLE = "env.id=examples.env_groups.pole_cartpole:PoleCartPole-v1"
TWO_GROUPS = "env.groups=[{name: short, kwargs: {length: 0.25}, num_envs: 1}, {name: long, kwargs: {length: 1.0}}]"
SPLIT4 = ["layout.mode=split", "layout.trainer=1", "layout.inference=1", "layout.env=2"]


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["env.groups=[{name: a, lenght: 1}]"], "unknown config key 'env.groups[0].lenght'"),
        (["env.groups=[{kwargs: {}}]"], "'env.groups[0].name'"),
        (["env.groups=[{name: 'a b'}]"], "'env.groups[0].name'"),
        (["env.groups=[{name: a}, {name: a}]"], "group 'a' is named twice"),
        (["env.groups=[a, b]"], "'env.groups[0]' must be a mapping"),
        (["env.groups={name: a}"], "'env.groups' must be a list of mappings"),
        (["env.groups=[{name: a, num_envs: -1}]"], "'env.groups[0].num_envs' = -1 is out of range"),
        (["env.groups=[{name: a}]", "env.backend=envpool"], "env.groups needs env.backend=gymnasium"),
        (["env.groups=[{name: a}]", "env.vectorization=vector_entry_point"], "not vector_entry_point"),
        (["eval.env={num_envs: 3}"], "unknown config key 'eval.env.num_envs'"),
        (["eval.env={groups: [{name: a}, {name: a}]}"], "'eval.env.groups[1].name'"),
    ],
)
def test_bad_group_keys_are_refused_naming_the_key(overrides, expected):
    with pytest.raises(UserError, match=expected.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")):
        load_config(ROOT / "configs" / "ci_tiny.yaml", overrides)


def test_group_counts_resolve_per_env_rank_and_a_count_that_does_not_divide_names_the_group():
    groups = "env.groups=[{name: a, total_envs: 4}, {name: b, num_envs: 3}, {name: c}]"
    cfg = load_config(ROOT / "configs" / "ci_tiny.yaml", [groups, "env.num_envs=1", *SPLIT4])
    plan = plan_run(cfg, build_topology(cfg.layout, 4), PPO)
    assert [g.num_envs for g in plan.env.groups] == [2, 3, 1]  # a: 4 over 2 env ranks; c: env.num_envs
    assert plan.env.num_envs == 6 and plan.envs_total == 12
    assert "in groups a (2 per env rank), b (3 per env rank), c (1 per env rank)" in plan.describe(cfg, 4, "split", PPO)
    # Inherited env.total_envs is written into the group: config.yaml reads back the same at any world size.
    cfg = load_config(ROOT / "configs" / "ci_tiny.yaml", ["env.groups=[{name: a}, {name: b}]", "env.total_envs=4"])
    env = plan_run(cfg, build_topology(cfg.layout, 1), PPO).env
    assert [(g.total_envs, g.num_envs) for g in env.groups] == [(4, 4), (4, 4)] and env.num_envs == 8

    cfg = load_config(ROOT / "configs" / "ci_tiny.yaml", ["env.groups=[{name: a}, {name: b, total_envs: 3}]"])
    with pytest.raises(UserError, match=r"env.groups\[1\].total_envs \(group 'b'\)=3 cannot be shared equally by 2"):
        plan_run(cfg, build_topology(cfg.layout, 2), PPO)


def test_groups_whose_spaces_differ_are_exit_2_with_one_line_naming_both_before_start(tmp_path):
    groups = "env.groups=[{name: cart, id: CartPole-v1}, {name: pendulum, id: Pendulum-v1}]"
    result = run_main("--config", TINY, groups, f"run.dir={tmp_path / 'run'}")
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert "env groups 'cart' and 'pendulum' differ in their observation space" in lines[0]
    assert "Box([-4.8" in lines[0] and "Box([-1. -1. -8.]" in lines[0]
    assert not (tmp_path / "run").exists()


def test_an_eval_env_with_other_spaces_is_refused_naming_eval_env():
    cfg = load_config(ROOT / "configs" / "ci_tiny.yaml", ["eval.env={id: Pendulum-v1}"])
    with pytest.raises(UserError, match="eval.env gives another observation space than env"):
        check_same_spaces(probe_env(cfg.env), probe_env(evaluation_env(cfg)), "eval.env")


def _gather_groups_on_two_trainers(rank: int, world_size: int) -> None:
    # Each trainer's columns are groups [0, 1]; trainer r finishes one episode per column, of return 10 * (r + 1)
    # in group 0 and 100 * (r + 1) in group 1.
    done = torch.tensor([[True, True], [False, False]])
    returns = torch.tensor([[10.0, 100.0], [0.0, 0.0]]) * (rank + 1)
    segment = TensorDict(
        {
            "rollout": TensorDict(
                {"episode_done": done, "episode_return": returns, "episode_length": returns.long()},
                batch_size=[2, 2],
            ),
            "env_s": torch.tensor([1.0]),
            "action_wait_s": torch.tensor([0.5]),
            "inference_s": torch.tensor([0.25]),
            "rollout_s": torch.tensor([2.0]),
            "inference_idle_s": torch.tensor([0.125]),
        },
        batch_size=[],
    )
    trainer = Trainer(None, [], [], 4, dist.group.WORLD, describe=f"rank {rank}", column_groups=torch.tensor([0, 1]))
    statistics = trainer.gather_statistics(segment)
    if rank == 0:
        by_group = sorted(zip(statistics["groups"].tolist(), statistics["returns"].tolist()))
        assert by_group == [(0.0, 10.0), (0.0, 20.0), (1.0, 100.0), (1.0, 200.0)], by_group


def test_every_trainers_episodes_reach_the_first_with_their_groups():
    assert_all_ok(run_ranks(_gather_groups_on_two_trainers, 2, timeout_s=30))


def test_eval_env_kwargs_replace_env_kwargs_and_groups_still_merge_theirs_over_them():
    groups = "env.groups=[{name: a, kwargs: {length: 0.25}}, {name: b}]"
    cfg = load_config(
        ROOT / "configs" / "ci_tiny.yaml",
        [POLE, groups, "env.kwargs={length: 1.0, sutton_barto_reward: true}", "eval.env={kwargs: {length: 1.5}}"],
    )
    assert [(name, section.kwargs) for name, section in evaluation_env(cfg).group_sections()] == [
        ("a", {"length": 0.25}),
        ("b", {"length": 1.5}),
    ]
    assert [section.kwargs for _, section in cfg.env.group_sections()] == [
        {"length": 0.25, "sutton_barto_reward": True},
        {"length": 1.0, "sutton_barto_reward": True},
    ]
    assert evaluation_env(load_config(ROOT / "configs" / "ci_tiny.yaml")).groups == []


def test_a_run_without_groups_writes_no_group_keys():
    cfg = load_config(ROOT / "configs" / "ppo_cartpole.yaml")
    data = cfg.to_dict()
    assert "groups" not in data["env"] and "env" not in data["eval"]  # config.yaml and the run digest as before


GROUP_RUN_OVERRIDES = [
    "eval.env={groups: [{name: short, kwargs: {length: 0.25}}, {name: held, kwargs: {length: 0.75}}]}",
    "eval.every=4",
    "eval.episodes=2",
    "buffer.log_experience=true",
    "log.interval_s=0",
]


@pytest.fixture(scope="module")
def group_run(tmp_path_factory):
    """One process, two pole lengths, a held-out evaluation, experience logged."""
    run_dir = tmp_path_factory.mktemp("groups") / "run"
    result = run_main("--config", TINY, POLE, TWO_GROUPS, *GROUP_RUN_OVERRIDES, f"run.dir={run_dir}")
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir, result


def test_episode_statistics_and_evaluation_are_reported_per_group(group_run):
    run_dir, result = group_run
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 5  # 256 steps / (16 steps x 3 envs)
    last = records[-1]
    for name in ("short", "long"):
        assert f"episode_return_mean/{name}" in last and f"episode_length_mean/{name}" in last
    assert last["episodes"] > 0 and last["episode_return_mean/short"] is not None
    evaluated = records[3]
    assert {"eval_return_mean/short", "eval_return_mean/held", "eval_length_mean/held"} <= set(evaluated)
    mean_of_groups = (evaluated["eval_return_mean/short"] + evaluated["eval_return_mean/held"]) / 2
    assert evaluated["eval_return_mean"] == pytest.approx(mean_of_groups)  # equal episodes per group
    assert "(short " in result.stdout and " long " in result.stdout  # the console line's per-group returns
    assert "in groups short (1 per env rank), long (2 per env rank)" in result.stdout


def test_the_experience_file_records_each_rows_group(group_run):
    run_dir, _ = group_run
    with h5py.File(run_dir / "buffer" / "experience_rank0.h5", "r") as file:
        assert json.loads(file.attrs["group_names"]) == ["short", "long"]
        rows = int(file["cursor"][0])
        groups = file["data/group"][:rows]
        env_ids = file["meta/env_id"][:rows]
    assert rows == 5 * 16 * 3 and groups.dtype.kind == "i"
    assert (groups == (env_ids >= 1)).all()  # env 0 is short's, envs 1 and 2 are long's
    assert "  env groups: short 80 rows, long 160 rows\n" in summarize(run_dir / "buffer" / "experience_rank0.h5")


def evaluate_cli(*args) -> subprocess.CompletedProcess:
    """`python -m spmd_rl.evaluate ARGS`, as a user runs it."""
    command = [sys.executable, "-m", "spmd_rl.evaluate", *map(str, args)]
    return subprocess.run(command, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)


def test_the_command_line_evaluates_per_group_and_on_eval_env(group_run):
    run_dir, _ = group_run
    result = evaluate_cli(run_dir, "--episodes", "2", "--eval-env", "--json")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert list(out["groups"]) == ["short", "held"] and out["episodes"] == 4
    other_spaces = evaluate_cli(run_dir, "eval.env={groups: [{name: a, id: Acrobot-v1}]}", "--eval-env")
    assert other_spaces.returncode == 2, other_spaces.stderr
    assert other_spaces.stderr.startswith("spmd_rl.evaluate: error: eval.env gives another observation space")
    assert len(other_spaces.stderr.strip().splitlines()) == 1


def test_a_run_without_groups_logs_no_group_column(tmp_path):
    run_dir = tmp_path / "run"
    result = run_main("--config", TINY, "buffer.log_experience=true", "train.total_steps=64", f"run.dir={run_dir}")
    assert result.returncode == 0, result.stderr[-3000:]
    with h5py.File(run_dir / "buffer" / "experience_rank0.h5", "r") as file:
        assert "group" not in file["data"] and "group_names" not in file.attrs
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert "groups" not in saved["env"] and "env" not in saved["eval"]
    assert not any("/" in key for key in json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1]))


@pytest.mark.slow
@pytest.mark.parametrize("nproc, half", [(0, 2), (4, 2)], ids=["one-process", "split-4"])
def test_an_env_group_run_resumes_exactly(tmp_path, nproc, half):
    # N iterations in one go equal N/2, a stop and a resume, as tests/launchers/test_resume.py checks for one env.
    groups = "env.groups=[{name: short, kwargs: {length: 0.25}, total_envs: 2}, {name: long, kwargs: {length: 1.0}}]"
    steps = "train.total_steps=384"  # split 4: 4 iterations of 2 env ranks x 3 envs x 16 steps
    args = ["--config", TINY, POLE, groups, steps, "buffer.log_experience=true", *(SPLIT4 if nproc else [])]
    full = run_main(*args, f"run.dir={tmp_path / 'full'}", nproc=nproc)
    assert full.returncode == 0, full.stderr[-3000:]
    stopped = run_main(*args, f"run.dir={tmp_path / 'split'}", f"run.stop_after_iterations={half}", nproc=nproc)
    assert "rerun the same command to resume" in stopped.stderr, stopped.stderr[-3000:]
    resumed = run_main(*args, f"run.dir={tmp_path / 'split'}", f"run.stop_after_iterations={half}", nproc=nproc)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stdout
    assert "episode_return_mean/long" in (tmp_path / "full" / "metrics.jsonl").read_text()
    assert_same_run(tmp_path / "full", tmp_path / "split")
    for run in ("full", "split"):  # the group column continues at the checkpoint's row
        with h5py.File(tmp_path / run / "buffer" / "experience_rank0.h5", "r") as file:
            rows = int(file["cursor"][0])
            assert set(file["data/group"][:rows].tolist()) == {0, 1}


def test_the_shipped_config_runs_an_iteration():
    result = run_main("--config", str(ROOT / "configs" / "ppo_cartpole_groups.yaml"), "--dry-run", "log.progress=false")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "in groups short (4 per env rank), standard (4 per env rank), long (4 per env rank)" in result.stdout


def test_a_sweep_knows_a_finished_env_group_run_as_its_own(group_run, tmp_path):
    # config.yaml holds the counts the plan resolved (group num_envs, env.num_envs the sum): finished.json keeps the
    # digest of the config as given, which is what a sweep computes for its combination.
    run_dir, _ = group_run
    overrides = [POLE, TWO_GROUPS, *GROUP_RUN_OVERRIDES]
    sweep = plan_sweep(TINY, overrides, tmp_path, tmp_path / "sweep", "groups")
    shutil.copytree(run_dir, sweep.run_dir(sweep.combinations[0]))
    assert sweep.finished(0)
    other = plan_sweep(TINY, [*overrides, "train.seed=7"], tmp_path, tmp_path / "other", "groups")
    shutil.copytree(run_dir, other.run_dir(other.combinations[0]))
    assert not other.finished(0)  # another config's finished run is not this combination's
