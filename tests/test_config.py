"""Config loading, overrides and every kind of user error: exit code 2 and one line naming the key or file."""

import subprocess
import sys
from pathlib import Path

import pytest

from spmd_rl.config import Config, load_config
from spmd_rl.errors import UserError

ROOT = Path(__file__).resolve().parent.parent


def test_defaults_equal_the_default_config_file():
    assert load_config(None) == load_config(ROOT / "configs" / "ppo_cartpole.yaml")


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "configs").glob("*.yaml")))
def test_every_shipped_config_loads(name):
    assert isinstance(load_config(ROOT / "configs" / name), Config)


def test_overrides_are_typed_and_nested(tmp_path):
    cfg = load_config(None, ["train.total_steps=5000", "algo.learning_rate=3e-4", "model.hidden_sizes=[32,32]",
                             "env.kwargs={max_episode_steps: 100}", "algo.target_kl=0.02", "log.progress=false"])
    assert cfg.train.total_steps == 5000
    assert cfg.algo.learning_rate == pytest.approx(3e-4)
    assert cfg.model.hidden_sizes == [32, 32]
    assert cfg.env.kwargs == {"max_episode_steps": 100}
    assert cfg.algo.target_kl == pytest.approx(0.02)
    assert cfg.log.progress is False


def test_int_is_accepted_for_float_but_not_the_reverse():
    assert load_config(None, ["algo.learning_rate=1"]).algo.learning_rate == 1.0
    with pytest.raises(UserError, match="'train.total_steps' must be int"):
        load_config(None, ["train.total_steps=1.5"])


@pytest.mark.parametrize("overrides, message", [
    (["train.totl_steps=5"], "unknown config key 'train.totl_steps'.*did you mean 'train.total_steps'"),
    (["trian.seed=5"], "unknown config key 'trian'.*did you mean 'train'"),
    (["algo.gamma=1.5"], "'algo.gamma' = 1.5 is out of range; it must be <= 1.0"),
    (["env.num_envs=0"], "'env.num_envs' = 0 is out of range; it must be >= 1"),
    (["layout.mode=splt"], "'layout.mode' = 'splt' is not allowed.*did you mean 'split'"),
    (["train.seed=abc"], "'train.seed' must be int, got 'abc'"),
    (["anneal_lr"], "must look like section.key=value"),
    (["algo.anneal_lr=yes please"], "'algo.anneal_lr' must be bool"),
    (["model.hidden_sizes=[64, x]"], r"'model.hidden_sizes\[1\]' must be int"),
    (["train=5"], "'train' must be a mapping"),
])
def test_bad_overrides_name_the_key(overrides, message):
    with pytest.raises(UserError, match=message):
        load_config(None, overrides)


def test_unknown_nested_key_in_a_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("algo:\n  learning_rat: 0.1\n")
    with pytest.raises(UserError, match=r"unknown config key 'algo.learning_rat' \(in .*c.yaml\).*"
                                        r"did you mean 'algo.learning_rate'"):
        load_config(path)


def test_missing_file_and_invalid_yaml(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  seed: [1, 2\n")
    with pytest.raises(UserError, match=r"bad.yaml is not valid YAML at line \d+"):
        load_config(bad)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("42\n")
    with pytest.raises(UserError, match="must hold a mapping"):
        load_config(scalar)


def _main(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "spmd_rl.main", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("args, message", [
    (["train.total_stps=1"], "did you mean 'train.total_steps'"),
    (["--config", "configs/nope.yaml"], "configs/nope.yaml does not exist"),
    (["env.id=NoSuchEnv-v0"], "env.id 'NoSuchEnv-v0' cannot be made"),
    (["env.id=no_such_module:Env-v0"], "importing its module failed"),
    (["env.id=Blackjack-v1"], "observation space"),
    (["layout.mode=split", "layout.trainer=1", "layout.inference=1", "layout.env=1"], "world size is 1"),
    (["train.total_steps=10"], "less than one iteration"),
    (["env.id=CartPole"], "env.id 'CartPole' cannot be made"),
    (["env.id=Pendulum-v1", "env.vectorization=vector_entry_point"], "has no vectorized implementation"),
    (["dist.timeout_s=.inf"], "'dist.timeout_s' = inf must be a finite number"),
])
def test_command_line_user_errors_exit_2_with_one_line(args, message):
    result = _main(*args, "log.progress=false")
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_help_documents_the_sections():
    result = _main("--help")
    assert result.returncode == 0
    for key in ("train.total_steps", "layout.mode", "dist.timeout_s", "weights.verify_every", "env.num_envs"):
        assert key in result.stdout


def test_plan_rejects_unequal_trainer_shares_and_indivisible_sac_batches():
    from spmd_rl.engine import plan_run
    from spmd_rl.topology import build_topology

    split = ["layout.mode=split", "layout.trainer=2", "layout.inference=1"]
    cfg = load_config(None, split + ["layout.env=3"])
    with pytest.raises(UserError, match="layout.env=3 env ranks cannot be shared equally by layout.trainer=2"):
        plan_run(cfg, build_topology(cfg.layout, 6))
    cfg = load_config(None, split + ["layout.env=4", "algo.name=sac", "sac.batch_size=255"])
    with pytest.raises(UserError, match="sac.batch_size=255 must be a multiple of the 2 trainer ranks"):
        plan_run(cfg, build_topology(cfg.layout, 7))
    cfg = load_config(None, split + ["layout.env=4"])
    assert plan_run(cfg, build_topology(cfg.layout, 7)).num_iterations > 0
