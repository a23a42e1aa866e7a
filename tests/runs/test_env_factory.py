"""env.id may name a factory, 'module:make_env' returning a gymnasium Env (the SB3 / CleanRL habit): it is made
with env.kwargs on every rank and in async vectorization's workers."""

import json

import pytest
from harness.runs import TINY, run_main


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [0, 2])
def test_an_env_factory_trains_with_its_kwargs(tmp_path, nproc):
    run_dir = tmp_path / "run"
    result = run_main(
        "--config",
        TINY,
        f"run.dir={run_dir}",
        "env.id=tests.harness.env_factories:make_cartpole",
        "env.kwargs={limit: 10}",
        "env.vectorization=async",
        nproc=nproc,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert records and all(r["episode_length_mean"] <= 10 for r in records if r["episode_length_mean"])
