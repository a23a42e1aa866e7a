"""env.pipeline_stages: how an env rank's envs split into stages (each env in one stage, a group whole, every env
seeded as with one stage), the configs refused before start, and the thread a stage steps on in one process. Runs
with stages: tests/runs/test_pipeline_runs.py (split layout), tests/runs/test_pipeline_in_process.py (one process)."""

from __future__ import annotations

import threading

import pytest
from harness.launch import ROOT

from spmd_rl.algorithms.ppo import PPO
from spmd_rl.config.loading import load_config
from spmd_rl.envs.backend import group_seeds
from spmd_rl.roles.env_step_thread import EnvStepThread
from spmd_rl.roles.pipelined_env_runner import stage_columns, stage_seed
from spmd_rl.run.plan import plan_run
from spmd_rl.run.topology import build_topology
from spmd_rl.runtime.errors import UserError

SPLIT3 = ["layout.mode=split", "layout.trainer=1", "layout.inference=1", "layout.env=1"]


def seeds_of_envs(seed: int, num_envs: int, group_size: int) -> list[int]:
    """The seed each env's first reset takes (gymnasium: seed + i when one seed is given)."""
    seeds = group_seeds(seed, num_envs, group_size)
    return [seeds + i for i in range(num_envs)] if isinstance(seeds, int) else seeds


@pytest.mark.parametrize("num_envs, stages, group_size", [(8, 1, 1), (8, 2, 1), (8, 4, 2), (12, 3, 4), (6, 6, 1)])
def test_stages_partition_the_envs_keep_groups_whole_and_seed_every_env_as_one_stage_does(num_envs, stages, group_size):
    columns = stage_columns(num_envs, stages)
    envs = [i for block in columns for i in range(num_envs)[block]]
    assert envs == list(range(num_envs))  # each env in exactly one stage, in order
    assert len({block.stop - block.start for block in columns}) == 1  # equal stages
    for first in range(0, num_envs, group_size):  # a group's envs all in one stage
        assert (
            len(
                {
                    s
                    for s, block in enumerate(columns)
                    for i in range(first, first + group_size)
                    if i in range(num_envs)[block]
                }
            )
            == 1
        )
    seed = 1_000_003 * 7 + 5 * num_envs
    staged = [
        env_seed
        for block in columns
        for env_seed in seeds_of_envs(stage_seed(seed, block, group_size), block.stop - block.start, group_size)
    ]
    assert staged == seeds_of_envs(seed, num_envs, group_size)


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["env.num_envs=8", "env.pipeline_stages=3", *SPLIT3], "env.pipeline_stages=3 does not divide the 8 envs"),
        (
            ["env.num_envs=8", "env.group_size=8", "env.pipeline_stages=2", *SPLIT3],
            "env.pipeline_stages=2 would split the env.group_size=8 blocks",
        ),
        (["env.num_envs=8", "env.pipeline_stages=2"], "use layout.mode=split"),
        (
            ["env.num_envs=8", "env.vectorization=sync", "env.pipeline_stages=2"],
            "env.backend=gymnasium with env.vectorization=sync steps them in this process: set env.vectorization=async",
        ),
        (
            ["env.num_envs=8", "env.vectorization=vector_entry_point", "env.pipeline_stages=2"],
            "env.vectorization=vector_entry_point steps them in this process",
        ),
        (
            ["env.num_envs=8", "env.vectorization=async", "env.pipeline_stages=3"],
            "env.pipeline_stages=3 does not divide the 8 envs",
        ),
        (
            ["env.num_envs=4", "env.group_size=4", "env.vectorization=async", "env.pipeline_stages=2"],
            "env.pipeline_stages=2 would split the env.group_size=4 blocks",
        ),
        (
            ["env.groups=[{name: a, num_envs: 2}, {name: b, num_envs: 2}]", "env.pipeline_stages=2", *SPLIT3],
            "env.pipeline_stages=2 with env.groups is not supported",
        ),
        (
            ["env.total_envs=12", "env.pipeline_stages=4", *SPLIT3[:3], "layout.env=2"],
            "does not divide the 6 envs of each env rank",
        ),
    ],
)
def test_stages_that_cannot_be_made_are_refused_before_start(overrides, expected):
    cfg = load_config(ROOT / "configs" / "ci_tiny.yaml", overrides)
    world = 1 if cfg.layout.mode != "split" else cfg.layout.trainer + cfg.layout.inference + cfg.layout.env
    with pytest.raises(UserError, match=expected.replace(".", r"\.").replace("[", r"\[")):
        plan_run(cfg, build_topology(cfg.layout, world), PPO)


def test_the_stage_count_must_be_positive():
    with pytest.raises(UserError, match="env.pipeline_stages"):
        load_config(ROOT / "configs" / "ci_tiny.yaml", ["env.pipeline_stages=0"])


@pytest.mark.parametrize("layout", [[], ["layout.env=2", *SPLIT3[:3]]], ids=["one-process", "split"])
@pytest.mark.parametrize("envs", [["env.vectorization=async"], ["env.backend=envpool"]], ids=["async", "envpool"])
def test_stages_of_envs_that_step_outside_python_are_planned_in_one_process_and_split(layout, envs):
    overrides = [*layout, "env.num_envs=8", *envs, "env.pipeline_stages=4"]
    cfg = load_config(ROOT / "configs" / "ci_tiny.yaml", overrides)
    world = 1 if cfg.layout.mode != "split" else cfg.layout.trainer + cfg.layout.inference + cfg.layout.env
    assert plan_run(cfg, build_topology(cfg.layout, world), PPO).env.pipeline_stages == 4


class CountingSteps:
    """A vector env's stand-in for the step thread: its step returns the actions it got, raises on a negative one,
    or waits for `release` (a step in flight)."""

    def __init__(self):
        self.release = threading.Event()
        self.release.set()

    def step(self, action):
        self.release.wait(timeout=30)
        if action < 0:
            raise ValueError(f"bad action {action}")
        return (action,)


def test_the_step_thread_hands_back_each_step_and_its_error_and_stops_after_a_step_in_flight():
    envs = CountingSteps()
    thread = EnvStepThread(envs, "test step")
    for action in (1, 2):
        thread.start(action)
        (result,), seconds = thread.wait()
        assert result == action and seconds >= 0
    thread.start(-1)
    with pytest.raises(ValueError, match="bad action -1"):
        thread.wait()
    envs.release.clear()
    thread.start(3)  # in flight until released: stop waits for it, then ends the thread
    threading.Timer(0.2, envs.release.set).start()
    thread.stop()
    assert not thread._thread.is_alive()
