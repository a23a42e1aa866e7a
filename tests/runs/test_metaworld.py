"""MetaWorld's envs for real (MuJoCo 3.3.0, EGL or OSMesa): a task renders its camera and resets to the same state
from the same seed, the instruction reaches the policy as token ids, the scripted expert's episodes go to HDF5 and
a second call continues the file, and bad input is one line, exit 2."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
import warnings

import gymnasium as gym
import numpy as np
import pytest
from harness.launch import ROOT, job_env
from harness.runs import TINY, assert_one_line_exit_2, run_main

from spmd_rl.algorithms.demonstrations import check_files, expected_layout, read_share
from spmd_rl.config.loading import load_config
from spmd_rl.config.sections import EnvSection
from spmd_rl.envs.metaworld_envs import INSTRUCTIONS, register, scripted_expert
from spmd_rl.envs.vector import make_vector_env, probe_env
from spmd_rl.run.contract import load_classes
from spmd_rl.run.evaluation import evaluate
from spmd_rl.storage.reader import HDF5Reader

pytest.importorskip("metaworld", reason='MetaWorld is not installed (pip install -e ".[metaworld]")')

REACH = str(ROOT / "configs" / "metaworld" / "reach_collect.yaml")


def test_a_task_renders_and_resets_to_one_state_per_seed():
    register("metaworld/reach-v3")
    env = gym.make("metaworld/reach-v3", width=32, height=24)
    try:
        first, info = env.reset(seed=7)
        assert first["image"].shape == (24, 32, 3) and first["image"].dtype == np.uint8
        assert first["image"].std() > 10  # a scene, not a blank frame
        assert first["instruction"] == INSTRUCTIONS["reach-v3"] and first["state"].shape == (4,)
        assert info["task"] == "reach-v3" and info["task_index"] == 7
        moved, _, _, _, step_info = env.step(np.array([1.0, 0.0, 0.0, 0.0], dtype=np.float32))
        assert not np.array_equal(moved["image"], first["image"]) and "success" in step_info
        again, again_info = env.reset(seed=7)  # configuration 7 again: the same state and image
        assert np.array_equal(again["image"], first["image"])
        assert np.array_equal(again_info["metaworld_observation"], info["metaworld_observation"])
        other, other_info = env.reset(seed=8)
        assert not np.array_equal(other_info["metaworld_observation"][4:7], info["metaworld_observation"][4:7]) or (
            not np.array_equal(other_info["metaworld_observation"][-3:], info["metaworld_observation"][-3:])
        )
    finally:
        env.close()


def test_a_success_reward_pays_one_on_the_success_step_only():
    """reward: success, for PPO: MetaWorld's dense reward paid more for hovering short of success until the step limit
    than for succeeding (the episode ends at success), and PPO from an SFT policy learned to hover."""
    register("metaworld/reach-v3")
    env = gym.make("metaworld/reach-v3", width=16, height=16, reward="success")
    expert = scripted_expert("reach-v3")
    try:
        _, info = env.reset(seed=3)
        rewards, terminated = [], False
        while not terminated and len(rewards) < 150:
            action = np.clip(expert.get_action(info["metaworld_observation"]), -1, 1).astype(np.float32)
            _, reward, terminated, _, info = env.step(action)
            rewards.append(reward)
        assert terminated and info["success"] and rewards[-1] == 1.0 and set(rewards[:-1]) == {0.0}
    finally:
        env.close()


def test_push_renders_its_goal_where_the_seed_puts_it_whatever_the_last_episode_left():
    """push-v3 sets its goal marker's height from where the puck is when the reset begins; MetaWorld moves the marker
    after its last kinematics pass, so the first frame showed the marker where the last episode's puck left it and a
    group's members (same seed, different pasts) saw different first images."""
    register("metaworld/push-v3")
    moved, fresh = gym.make("metaworld/push-v3"), gym.make("metaworld/push-v3")
    try:
        moved.reset(seed=3)
        sim = moved.unwrapped._active
        qpos = sim.data.qpos.copy()
        qpos[11] += 0.3  # the last episode ended with the puck lifted (the free joint's z)
        sim.set_state(qpos, sim.data.qvel.copy())
        first, _ = moved.reset(seed=7)
        other, _ = fresh.reset(seed=7)
        assert np.array_equal(first["image"], other["image"])
        assert np.array_equal(sim.data.site("goal").xpos, sim.model.site("goal").pos)
    finally:
        moved.close()
        fresh.close()


def test_an_env_renders_on_after_another_env_of_its_process_closes():
    # An evaluation's envs close beside the training envs of a colocated rank: MuJoCo's EGL context went with them,
    # and the training envs rendered black frames from then on (a GRPO run learned from blank images).
    register("metaworld/reach-v3")
    kept, closed = (gym.make("metaworld/reach-v3", width=32, height=24) for _ in range(2))
    try:
        kept.reset(seed=1)
        closed.reset(seed=2)
        closed.close()
        after, *_ = kept.step(np.zeros(4, dtype=np.float32))
        assert after["image"].std() > 10  # a scene, not a black frame
    finally:
        kept.close()


def test_the_instruction_arrives_as_token_ids_and_a_group_starts_together():
    cfg = EnvSection(id="metaworld/push-v3", num_envs=2, group_size=2, max_text_tokens=32)
    spec = probe_env(cfg)
    assert spec.success_key == "success" and "renders with MUJOCO_GL=" in spec.note
    envs, obs = make_vector_env(cfg, spec, seed=3)
    try:
        sentence = INSTRUCTIONS["push-v3"].encode()
        ids, mask = obs["instruction"]["ids"], obs["instruction"]["mask"]
        assert ids.dtype == np.uint8 and ids.shape == (2, 32)
        assert bytes(ids[0, : len(sentence)]) == sentence and mask[0].sum() == len(sentence)
        assert np.array_equal(obs["image"][0], obs["image"][1])  # one seed for the group: one initial state
    finally:
        envs.close()


def test_an_evaluation_over_mt10_reports_success_per_task():
    # One policy over MT10's ten tasks: its result reads per task (evaluate's lines, the metrics'
    # eval_success_rate/task/<name>), each episode counted under the task its info named
    cfg = load_config(
        None, ["env.id=metaworld/MT10", "env.num_envs=2", "env.action_chunk=4", "env.kwargs={width: 32, height: 32}"]
    )
    spec = probe_env(cfg.env)
    policy_cls, _ = load_classes(cfg)[:2]
    policy = policy_cls(spec.observation_space, spec.action_space, cfg.policy)
    result = evaluate(policy, cfg.env, episodes=10, seed=0, deterministic=True, max_steps=8)
    mt10 = {"reach-v3", "push-v3", "pick-place-v3", "door-open-v3", "drawer-open-v3", "drawer-close-v3",
            "button-press-topdown-v3", "peg-insert-side-v3", "window-open-v3", "window-close-v3"}  # fmt: skip
    assert 1 < len(result["tasks"]) and set(result["tasks"]) <= mt10  # later resets draw their task at random
    assert sum(done["episodes"] for done in result["tasks"].values()) == 10
    per_task = sum(done["success_rate"] * done["episodes"] for done in result["tasks"].values())
    assert per_task == pytest.approx(result["success_rate"] * result["episodes"])


def test_an_expert_far_from_its_target_acts_without_metaworlds_clipping_warning():
    # MetaWorld's controllers warn at every step whose response exceeds [-1, 1] (collect clips the action): a
    # collect of MT10 printed it among its lines
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert scripted_expert("pick-place-v3").get_action(np.r_[np.zeros(4), np.ones(35)]).shape == (4,)
    assert not [w for w in caught if "may be too high" in str(w.message)]


@pytest.mark.slow
def test_collect_writes_expert_episodes_and_continues_the_file(tmp_path):
    out = tmp_path / "reach.h5"

    def collect(episodes: int, *overrides: str) -> subprocess.CompletedProcess:
        line = [sys.executable, "-m", "spmd_rl.collect", "--config", REACH, "--episodes", str(episodes), *overrides]
        return subprocess.run(
            [*line, "--out", str(out)], cwd=ROOT, env=job_env(), capture_output=True, text=True, timeout=300
        )

    first = collect(1)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "renders with MUJOCO_GL=" in first.stdout and "holds 1 episodes; this call wrote 1" in first.stdout
    second = collect(2)  # continues: episode 1 from seed 1, episode 0 kept
    assert second.returncode == 0, second.stderr[-3000:]
    assert "holds 2 episodes; this call wrote 1" in second.stdout
    with HDF5Reader(out) as reader:
        assert reader.check_rows()  # every chunk's checksum
        rows = reader.read(meta=True)
    assert rows["obs/image"].dtype == np.uint8 and rows["obs/image"].shape[1:] == (64, 64, 3)
    assert rows["action"].shape[1:] == (4, 4) and np.abs(rows["action"]).max() <= 1.0
    assert list(np.unique(rows["episode"])) == [0, 1] and list(np.unique(rows["episode_seed"])) == [0, 1]
    ends = np.flatnonzero(rows["terminated"] | rows["truncated"])
    assert len(ends) == 2 and ends[-1] == len(rows["episode"]) - 1
    assert rows["episode_success"].all() and rows["success"][ends].all()  # reach's expert succeeds, which ends it
    sentence = INSTRUCTIONS["reach-v3"].encode()
    assert bytes(rows["obs/instruction/ids"][0, : len(sentence)]) == sentence
    steps = rows["meta/env_step"]
    assert steps[0] == 0 and np.all(np.diff(steps) > 0)  # primitive steps counted on over both calls
    assert rows["valid"].all()  # every row a decision: bc leaves out rows whose valid is false

    # bc reads the file as the SFT config's policy sees the env: both episodes, every decision, two trainers' shares.
    sft_env = load_config(ROOT / "configs" / "metaworld" / "reach_sft.yaml").env
    spec = probe_env(sft_env)  # with its chunks: actions [4, 4]
    layout = expected_layout(spec.observation_space, spec.action_space)
    check_files([out], layout)
    shares = [read_share([out], layout, trainer, 2) for trainer in (0, 1)]
    assert [share.episodes for share in shares] == [2, 2]
    assert sum(len(share.decisions) for share in shares) == len(rows["action"])
    assert np.array_equal(shares[0].decisions["action"].numpy(), rows["action"][rows["episode"] == 0])

    other = collect(3, "env.max_episode_steps=90")  # the same file with other settings is refused
    assert other.returncode == 2 and "holds other episodes than these settings collect" in other.stderr


def test_a_stop_signal_ends_collect_after_its_episode_with_one_line(tmp_path):
    out = tmp_path / "reach.h5"  # episodes of at most 20 steps: many end before the signal comes
    line = [sys.executable, "-m", "spmd_rl.collect", "--config", REACH, "--episodes", "100000", "--out", str(out)]
    run = subprocess.Popen(
        [*line, "env.max_episode_steps=20"], cwd=ROOT, env=job_env(), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert "renders with MUJOCO_GL=" in run.stdout.readline()  # the env is made: episodes are being played
        time.sleep(5)
        run.send_signal(signal.SIGTERM)
        _, stderr = run.communicate(timeout=120)
    finally:
        if run.poll() is None:
            run.kill()
            run.communicate()
    assert run.returncode == 75, stderr[-3000:]
    ours = [line for line in stderr.splitlines() if line.startswith("spmd_rl")]  # the expert's own UserWarning aside
    assert len(ours) == 1 and "Traceback" not in stderr, stderr[-3000:]
    held = int(re.search(rf"stopped by SIGTERM: {re.escape(str(out))} holds (\d+) of 100000 episodes", stderr)[1])
    with HDF5Reader(out) as reader:
        assert reader.check_rows()
        rows = reader.read(meta=True)
    assert held > 0 and list(np.unique(rows["episode"])) == list(range(held))  # whole episodes, none cut short
    assert (rows["terminated"] | rows["truncated"])[-1]


def test_success_only_gives_up_when_too_few_attempts_succeed(tmp_path):
    out = tmp_path / "reach.h5"  # 4 steps: too few for the expert to reach the goal
    line = [sys.executable, "-m", "spmd_rl.collect", "--config", REACH, "--episodes", "1", "--success-only"]
    result = subprocess.run(
        [*line, "--out", str(out), "env.max_episode_steps=4"],
        cwd=ROOT, env=job_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-3000:]
    assert "--success-only: 0 of 20 attempts succeeded, too few for 1 episodes (0 in" in result.stderr
    with HDF5Reader(out) as reader:
        assert len(reader) == 0  # no failed episode was written


@pytest.mark.parametrize(
    ("overrides", "variables", "expected"),
    [
        (["env.id=metaworld/rech-v3"], {}, "MetaWorld has no task 'rech-v3'; did you mean metaworld/reach-v3"),
        (["env.id=metaworld/reach-v3", "env.kwargs.camera=nowhere"], {}, "scene has no camera 'nowhere'; its cameras"),
        # A GL platform that is neither EGL nor OSMesa: both fail to load, as on a machine without either.
        (["env.id=metaworld/reach-v3"], {"PYOPENGL_PLATFORM": "glx"}, "need headless rendering, and none works here"),
        (["env.id=metaworld/reach-v3", "env.kwargs.reward=sparse"], {}, "reward='sparse' is not one of dense"),
    ],
    ids=["unknown-task", "unknown-camera", "no-renderer", "unknown-reward"],
)
def test_bad_metaworld_input_is_one_line_exit_2(tmp_path, overrides, variables, expected):
    env = job_env(**variables)
    env.pop("MUJOCO_GL", None)
    result = run_main("--config", TINY, *overrides, f"run.dir={tmp_path}/run", env=env)
    assert_one_line_exit_2(result, expected)
