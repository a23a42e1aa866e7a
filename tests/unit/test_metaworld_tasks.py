"""MetaWorld's tasks as env ids, without rendering (tests/runs/test_metaworld.py renders): every task has an
instruction, an unknown task is one line naming the nearest ones, a demonstration row's layout, and the recipe's
configs (collect, SFT, GRPO, PPO per task, and SFT from one demonstration) load and agree on what the policy sees."""

from __future__ import annotations

from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest

from spmd_rl.collect import demonstration_layout
from spmd_rl.config.loading import load_config
from spmd_rl.envs.metaworld_envs import INSTRUCTIONS, interleaved_tasks, is_metaworld_id, register
from spmd_rl.envs.text import TokenizedText
from spmd_rl.runtime.errors import UserError

ROOT = Path(__file__).resolve().parents[2]
metaworld = pytest.importorskip("metaworld", reason='MetaWorld is not installed (pip install -e ".[metaworld]")')


def test_every_metaworld_task_has_an_instruction():
    assert set(INSTRUCTIONS) == set(metaworld.ALL_V3_ENVIRONMENTS)
    assert len(set(INSTRUCTIONS.values())) == len(INSTRUCTIONS)  # the instruction tells every task apart


def test_an_unknown_task_names_the_nearest_ones():
    with pytest.raises(UserError, match=r"MetaWorld has no task 'rech-v3'; did you mean metaworld/reach-v3"):
        register("metaworld/rech-v3")
    assert is_metaworld_id("metaworld/MT10") and not is_metaworld_id("Meta-World/MT1")


def test_mt10_seeds_take_its_tasks_in_turn():
    tasks = [metaworld.Task(env_name=name, data=bytes([i])) for name in ("a", "b") for i in range(3)]
    order = interleaved_tasks(tasks, ["a", "b"])  # seed s: task s mod 2, its configuration s div 2
    assert [(task.env_name, task.data[0]) for task in order] == [
        ("a", 0),
        ("b", 0),
        ("a", 1),
        ("b", 1),
        ("a", 2),
        ("b", 2),
    ]
    assert interleaved_tasks(tasks[:3], ["a"]) == tasks[:3]  # one task: MetaWorld's order


def test_a_demonstration_row_holds_the_observation_the_chunk_and_the_outcome():
    observation = gym.spaces.Dict(
        {
            "image": gym.spaces.Box(0, 255, (64, 64, 3), dtype=np.uint8),
            "instruction": TokenizedText(256, 48),
        }
    )
    layout = demonstration_layout(observation, gym.spaces.Box(-1, 1, (4,), dtype=np.float32), chunk=4)
    assert layout["obs/image"] == ((64, 64, 3), np.dtype(np.uint8))
    assert layout["obs/instruction/ids"] == ((48,), np.dtype(np.uint8))
    assert layout["action"] == ((4, 4), np.dtype(np.float32)) and layout["valid"] == ((), np.dtype(np.bool_))
    assert layout["reward"] == ((4,), np.dtype(np.float32)) and layout["chunk_valid"] == ((4,), np.dtype(np.bool_))
    single = demonstration_layout(observation, gym.spaces.Box(-1, 1, (4,), dtype=np.float32), chunk=1)
    assert single["action"] == ((4,), np.dtype(np.float32)) and "chunk_valid" not in single


@pytest.mark.parametrize("path", sorted((ROOT / "configs" / "metaworld").glob("*.yaml")), ids=lambda path: path.name)
def test_the_metaworld_configs_load_and_name_a_metaworld_task(path):
    env = load_config(path).env
    name = env.id.partition("/")[2]
    assert env.id.startswith("metaworld/") and (name in INSTRUCTIONS or name == "MT10")
    tasks = MT10 if name == "MT10" else (name,)
    assert env.max_text_tokens >= max(len(INSTRUCTIONS[task].encode()) for task in tasks)


MT10 = ("reach-v3", "push-v3", "pick-place-v3", "door-open-v3", "drawer-open-v3", "drawer-close-v3",
        "button-press-topdown-v3", "peg-insert-side-v3", "window-open-v3", "window-close-v3")  # fmt: skip


RECIPE_TASKS = ("reach", "push", "drawer_open")  # the tasks configs/metaworld holds the whole recipe of
RECIPE_STEPS = ("collect", "sft", "grpo", "ppo")


@pytest.mark.parametrize("task", RECIPE_TASKS)
def test_a_task_recipe_collects_sfts_and_rls_on_one_env_and_policy(task):
    configs = {step: load_config(ROOT / "configs" / "metaworld" / f"{task}_{step}.yaml") for step in RECIPE_STEPS}
    assert {step: cfg.classes["algo"] for step, cfg in configs.items() if step != "collect"} == {
        "sft": "bc",
        "grpo": "grpo",
        "ppo": "ppo",
    }
    collected = configs["collect"].env
    for step in ("sft", "grpo", "ppo"):
        env = configs[step].env
        # The demonstrations hold what the SFT policy sees, and RL loads its weights: one observation and chunk
        # (the reward, which PPO sets to success, is no part of what the policy sees).
        seen = {key: value for key, value in env.kwargs.items() if key != "reward"}
        assert (env.id, seen, env.action_chunk, env.max_text_tokens, env.max_episode_steps) == (
            collected.id,
            collected.kwargs,
            collected.action_chunk,
            collected.max_text_tokens,
            collected.max_episode_steps,
        ), step
        assert env.action_chunk > 1 and configs[step].policy == configs["sft"].policy, step
        assert configs[step].eval.every > 0 and configs[step].eval.episodes >= 50, step  # success rates as it learns
    assert configs["sft"].algo.demos == f"demos/{task}.h5"
    assert configs["grpo"].env.group_size > 1 and configs["grpo"].algo.outcome in ("auto", "success")
    assert configs["grpo"].train.total_steps == configs["ppo"].train.total_steps == 500_000


ONE_DEMO_TASKS = ("reach", "push")  # the tasks with a one-demonstration SFT config (<task>_sft_one_demo.yaml)


@pytest.mark.parametrize("task", ONE_DEMO_TASKS)
def test_a_one_demo_sft_sees_what_the_task_recipe_sees(task):
    one_demo = load_config(ROOT / "configs" / "metaworld" / f"{task}_sft_one_demo.yaml")
    sft = load_config(ROOT / "configs" / "metaworld" / f"{task}_sft.yaml")
    # Its demonstration comes from <task>_collect.yaml and GRPO starts from its weights: the SFT's env and policy.
    assert one_demo.classes["algo"] == "bc" and one_demo.algo.demos == f"demos/{task}_one_demo.h5"
    assert one_demo.env == sft.env and one_demo.policy == sft.policy
    # Success over the 50 task configurations, measured after the last iteration too.
    assert one_demo.eval.episodes >= 50 and one_demo.algo.iterations % one_demo.eval.every == 0
