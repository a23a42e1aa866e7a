"""env.pipeline_stages with env.backend=envpool: one pool per stage (envs/backends/envpool.py says why not one
pool's batches). The stages' pools step exactly as one pool of all the envs (same seeds, step by step); two stages
give the run of one stage byte for byte in one process (each pool steps on a thread while the policy acts) and in
the split layout; a run of two stages stopped and resumed is the run of one stage stopped and resumed (EnvPool's
envs are not saved: both resumes begin fresh episodes). Skipped only where envpool is not installed (CI installs
the extra)."""

from __future__ import annotations

import numpy as np
import pytest
from harness.runs import TINY, assert_same_run, run_main

from spmd_rl.config.sections import EnvSection
from spmd_rl.envs.vector import make_vector_env, probe_env
from spmd_rl.roles.pipelined_env_runner import stage_columns, stage_seed

pytest.importorskip("envpool", reason='pip install -e ".[envpool]"')

ENVPOOL = ["--config", TINY, "env.backend=envpool", "env.num_envs=8", "train.total_steps=512"]
SPLIT3 = ["layout.mode=split", "layout.trainer=1", "layout.inference=1", "layout.env=1"]


def test_the_stages_pools_step_as_one_pool_of_all_the_envs():
    cfg = EnvSection(id="CartPole-v1", backend="envpool", num_envs=8)
    spec, seed = probe_env(cfg), 11
    whole, whole_obs = make_vector_env(cfg, spec, seed)
    columns = stage_columns(8, 2)
    stages = [
        make_vector_env(EnvSection(id="CartPole-v1", backend="envpool", num_envs=4), spec, stage_seed(seed, c, 1))
        for c in columns
    ]
    np.testing.assert_array_equal(whole_obs, np.concatenate([obs for _, obs in stages]))
    rng = np.random.default_rng(0)
    ends = 0
    for _ in range(300):  # past several episode ends and their reset steps
        action = rng.integers(0, 2, 8)
        expected = whole.step(action)
        got = [envs.step(action[c]) for (envs, _), c in zip(stages, columns)]
        for i in range(4):  # observation, reward, terminated, truncated
            np.testing.assert_array_equal(expected[i], np.concatenate([step[i] for step in got]))
        ends += int(expected[2].sum() + expected[3].sum())
    assert ends >= 8
    for envs in [whole, *(envs for envs, _ in stages)]:
        envs.close()


@pytest.mark.parametrize("layout", [[], SPLIT3], ids=["one-process", "split"])
def test_two_stages_of_envpool_give_the_run_of_one_stage(tmp_path, layout):
    nproc = 3 if layout else 0
    one = run_main(*ENVPOOL, *layout, f"run.dir={tmp_path / 'one'}", nproc=nproc)
    assert one.returncode == 0, one.stderr[-2000:]
    two = run_main(*ENVPOOL, *layout, "env.pipeline_stages=2", f"run.dir={tmp_path / 'two'}", nproc=nproc)
    assert two.returncode == 0, two.stderr[-2000:]
    assert_same_run(tmp_path / "one", tmp_path / "two")


def test_a_resumed_run_of_two_envpool_stages_is_the_resumed_run_of_one(tmp_path):
    for stages in (1, 2):
        run = [*ENVPOOL, f"env.pipeline_stages={stages}", f"run.dir={tmp_path / str(stages)}"]
        stopped = run_main(*run, "run.stop_after_iterations=2")
        assert stopped.returncode == 75, stopped.stderr[-2000:]
        resumed = run_main(*run)
        assert resumed.returncode == 0, resumed.stderr[-2000:]
        assert "resuming from" in resumed.stdout
    assert_same_run(tmp_path / "1", tmp_path / "2")
