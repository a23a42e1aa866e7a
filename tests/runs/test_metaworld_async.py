"""MetaWorld's envs in async worker processes: the parent makes one env (the probe, and gymnasium's AsyncVectorEnv
to read its spaces) and so starts the GL renderer's threads, which a forked worker inherits the state of but not
the threads themselves. env.start_method=auto starts MetaWorld's workers by spawn: a run finishes, and the workers
play the episodes sync vectorization plays; forced to fork, the workers never answer and the watchdog's line says
where and what to set."""

from __future__ import annotations

import signal

import numpy as np
import pytest
from harness.launch import ROOT
from harness.runs import read_metrics, run_main

from spmd_rl.config.sections import EnvSection
from spmd_rl.envs.backends.gymnasium import start_method
from spmd_rl.envs.vector import make_vector_env, probe_env

pytest.importorskip("metaworld", reason='MetaWorld is not installed (pip install -e ".[metaworld]")')

SHORT_RUN = [
    "--config", str(ROOT / "configs" / "metaworld" / "reach_grpo.yaml"), "log.progress=false",
    "log.tensorboard=false", "env.num_envs=2", "env.group_size=2", "env.max_episode_steps=24",
    "train.total_steps=96", "eval.every=0",
]  # fmt: skip


def test_async_metaworld_runs_by_spawn(tmp_path):
    result = run_main(*SHORT_RUN, "env.vectorization=async", "dist.timeout_s=120", f"run.dir={tmp_path}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert [record["env_steps"] for record in read_metrics(tmp_path)] == [48, 96]


def test_spawned_workers_play_the_episodes_of_sync_vectorization():
    # Chunks of 4 and groups of 2, as the recipe's runs: the same seeds give the same states, images and rewards.
    played = {}
    for mode in ("sync", "async"):
        cfg = EnvSection(
            id="metaworld/reach-v3", num_envs=2, group_size=2, action_chunk=4, max_episode_steps=24,
            vectorization=mode, max_text_tokens=48,
        )  # fmt: skip
        spec = probe_env(cfg)  # the parent renders one env, as a run's env rank does before its envs start
        signal.alarm(240)  # a worker that never answers fails the test instead of hanging it
        try:
            envs, first = make_vector_env(cfg, spec, seed=5)
            actions = np.random.default_rng(0).uniform(-1, 1, (8, 2, 4, 4)).astype(np.float32)
            steps = [envs.step(action)[:4] for action in actions]  # 8 decisions: one episode end and reset each
            envs.close()
        finally:
            signal.alarm(0)
        played[mode] = (first, steps)
    assert start_method(cfg) == "spawn"
    (first, steps), (async_first, async_steps) = played["sync"], played["async"]
    for key in ("image", "state"):
        assert np.array_equal(first[key], async_first[key])
        assert all(np.array_equal(one[0][key], other[0][key]) for one, other in zip(steps, async_steps))
    for field in (1, 2, 3):  # rewards, terminations, truncations
        assert all(np.array_equal(one[field], other[field]) for one, other in zip(steps, async_steps))
    assert any(step[3].any() for step in steps)  # an episode was truncated inside the comparison


def test_forked_metaworld_workers_hang_and_the_line_says_what_to_set(tmp_path):
    # The bound covers the checks before start too: making one MetaWorld env to read its spaces took over 20 s once
    # at CI's load, before the forked workers could hang
    result = run_main(
        *SHORT_RUN, "env.vectorization=async", "env.start_method=fork", "dist.timeout_s=45", f"run.dir={tmp_path}"
    )
    assert result.returncode == 4, result.stderr[-3000:]
    assert (
        "making and resetting env.id metaworld/reach-v3 (in 2 env worker processes started by fork; if they never "
        "answer, as forks of a process holding a GL context do not, set env.start_method=spawn or "
        "env.vectorization=sync) did not return within 45 s"
    ) in result.stderr
