"""Config loading, overrides and every kind of user error: exit code 2 and one line naming the key or file."""

import re
from pathlib import Path

import pytest

from spmd_rl.config.loading import load_config
from spmd_rl.config.sections import Config
from spmd_rl.runtime.errors import UserError

ROOT = Path(__file__).resolve().parents[2]


def test_defaults_equal_the_default_config_file():
    # The file states its 8 envs over all env ranks (the same batch at any world size); the defaults per rank.
    shipped = load_config(ROOT / "configs" / "ppo_cartpole.yaml")
    assert shipped.env.total_envs == 8
    shipped.env.total_envs = 0
    assert load_config(None) == shipped


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "configs").glob("*.yaml")))
def test_every_shipped_config_loads(name):
    assert isinstance(load_config(ROOT / "configs" / name), Config)


def test_overrides_are_typed_and_nested(tmp_path):
    cfg = load_config(
        None,
        [
            "train.total_steps=5000",
            "algo.learning_rate=3e-4",
            "policy.hidden_sizes=[32,32]",
            "env.kwargs={max_episode_steps: 100}",
            "algo.target_kl=0.02",
            "log.progress=false",
        ],
    )
    assert cfg.train.total_steps == 5000
    assert cfg.algo.learning_rate == pytest.approx(3e-4)
    assert cfg.policy.hidden_sizes == [32, 32]
    assert cfg.env.kwargs == {"max_episode_steps": 100}
    assert cfg.algo.target_kl == pytest.approx(0.02)
    assert cfg.log.progress is False


def test_int_is_accepted_for_float_but_not_the_reverse():
    assert load_config(None, ["algo.learning_rate=1"]).algo.learning_rate == 1.0
    with pytest.raises(UserError, match="'train.total_steps' must be int"):
        load_config(None, ["train.total_steps=1.5"])


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["train.totl_steps=5"], "unknown config key 'train.totl_steps'.*did you mean 'train.total_steps'"),
        (["trian.seed=5"], "unknown config key 'trian'.*did you mean 'train'"),
        (["algo.gamma=1.5"], "'algo.gamma' = 1.5 is out of range; it must be <= 1.0"),
        (["env.num_envs=0"], "'env.num_envs' = 0 is out of range; it must be >= 1"),
        (["layout.mode=splt"], "'layout.mode' = 'splt' is not allowed.*did you mean 'split'"),
        (
            ["train.parallel=FSDP"],
            "'train.parallel' = 'FSDP' is not allowed; choose one of ddp, fsdp; did you mean 'fsdp'",
        ),  # case
        (["train.seed=abc"], "'train.seed' must be int, got 'abc'"),
        (["anneal_lr"], "must look like section.key=value"),
        (["algo.anneal_lr=yes please"], "'algo.anneal_lr' must be bool"),
        (["policy.hidden_sizes=[64, x]"], r"'policy.hidden_sizes\[1\]' must be int"),
        (["train=5"], "'train' must be a mapping"),
    ],
)
def test_bad_overrides_name_the_key(overrides, message):
    with pytest.raises(UserError, match=message):
        load_config(None, overrides)


def test_unknown_nested_key_in_a_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("algo:\n  learning_rat: 0.1\n")
    with pytest.raises(
        UserError,
        match=r"unknown config key 'algo.learning_rat' \(in .*c.yaml; keys of algorithm "
        r"'ppo'\).*did you mean 'algo.learning_rate'",
    ):
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


def test_plan_rejects_unequal_trainer_shares_and_indivisible_sac_batches():
    from spmd_rl.algorithms.ppo import PPO
    from spmd_rl.algorithms.sac import SAC
    from spmd_rl.run.plan import plan_run
    from spmd_rl.run.topology import build_topology

    split = ["layout.mode=split", "layout.trainer=2", "layout.inference=1"]
    cfg = load_config(None, split + ["layout.env=3"])
    with pytest.raises(UserError, match="layout.env=3 env ranks cannot be shared equally by layout.trainer=2"):
        plan_run(cfg, build_topology(cfg.layout, 6), PPO)
    cfg = load_config(None, split + ["layout.env=4", "algo.class=sac", "algo.batch_size=255"])
    with pytest.raises(UserError, match="algo.batch_size=255 must be a multiple of the 2 trainer ranks"):
        plan_run(cfg, build_topology(cfg.layout, 7), SAC)
    cfg = load_config(None, split + ["layout.env=4"])
    assert plan_run(cfg, build_topology(cfg.layout, 7), PPO).num_iterations > 0


@pytest.mark.parametrize(
    "config, world_size",
    [
        ("ppo_cartpole.yaml", 1),
        ("ppo_cartpole.yaml", 2),
        ("ppo_cartpole.yaml", 4),
        ("ppo_cartpole.yaml", 8),
        ("ppo_cartpole_split.yaml", 8),
    ],
)
def test_env_total_envs_keeps_the_global_batch_at_any_world_size(config, world_size):
    from spmd_rl.algorithms.ppo import PPO
    from spmd_rl.run.plan import plan_run
    from spmd_rl.run.topology import build_topology

    cfg = load_config(ROOT / "configs" / config)
    plan = plan_run(cfg, build_topology(cfg.layout, world_size), PPO)
    assert (plan.envs_total, plan.steps_per_iteration, plan.num_iterations) == (8, 256, 390)
    assert plan.env.num_envs * plan.env_ranks == 8
    assert cfg.env == load_config(ROOT / "configs" / config).env  # the config stays as given
    line = plan.describe(plan.run_config(cfg), world_size, "colocated", PPO)
    assert f"{plan.env_ranks} env rank(s) x {plan.env.num_envs} envs = 8 envs (env.total_envs)" in line


def test_env_total_envs_that_the_env_ranks_cannot_share_is_refused():
    from spmd_rl.algorithms.ppo import PPO
    from spmd_rl.run.plan import plan_run
    from spmd_rl.run.topology import build_topology

    cfg = load_config(ROOT / "configs" / "ppo_cartpole.yaml")
    with pytest.raises(UserError, match="env.total_envs=8 cannot be shared equally by 3 env ranks"):
        plan_run(cfg, build_topology(cfg.layout, 3), PPO)


# ---------------------------------------------------------------------------------------------------------------
# Bad input that used to slip through (issue 11): empty files, repeated keys, integers written as 1e4, widths and
# absurd sizes.


@pytest.mark.parametrize("text", ["", "# only a comment\n\n# and another\n", "---\n"])
def test_an_empty_config_file_is_an_error(tmp_path, text):
    path = tmp_path / "empty.yaml"
    path.write_text(text)
    with pytest.raises(UserError, match=r"config file .*empty.yaml is empty"):
        load_config(path)


@pytest.mark.parametrize(
    "text, message",
    [
        ("train:\n  seed: 1\n  total_steps: 5000\n  seed: 2\n", r"gives key 'train.seed' twice \(lines 2 and 4\)"),
        (
            "train:\n  seed: 1\nlog:\n  progress: false\ntrain:\n  seed: 2\n",
            r"gives key 'train' twice \(lines 1 and 5\)",
        ),
        ("env:\n  kwargs: {a: 1, b: 2, a: 3}\n", r"gives key 'env.kwargs.a' twice \(lines 2 and 2\)"),
    ],
)
def test_a_key_twice_in_a_file_names_the_key_the_file_and_the_lines(tmp_path, text, message):
    path = tmp_path / "twice.yaml"
    path.write_text(text)
    with pytest.raises(UserError, match=rf"config file .*twice.yaml {message}; keep one"):
        load_config(path)


def test_a_yaml_merge_may_override_the_keys_it_brings(tmp_path):
    path = tmp_path / "merge.yaml"
    path.write_text("env:\n  kwargs: {<<: {max_episode_steps: 10, b: 1}, max_episode_steps: 20}\n")
    assert load_config(path).env.kwargs == {"max_episode_steps": 20, "b": 1}


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["train.seed=1", "train.seed=2"],
            r"'train.seed' is set twice on the command line \('train.seed=1' and "
            r"'train.seed=2'\)",
        ),
        (["env.kwargs={a: 1}", "train.seed=3", "env.kwargs.a=2"], "'env.kwargs' is set twice"),
        (["train={seed: 1}", "train.seed=2"], "'train' is set twice"),
        (["env.kwargs={a: 1, a: 2}"], r"override 'env.kwargs=\{a: 1, a: 2\}' gives key 'a' twice"),
    ],
)
def test_a_key_twice_on_the_command_line_is_an_error(overrides, message):
    with pytest.raises(UserError, match=message):
        load_config(None, overrides)


def test_keys_that_only_share_letters_are_not_repeats():
    with pytest.raises(UserError, match="unknown config key 'train.seeds'"):
        load_config(None, ["train.seed=1", "train.seeds=2"])


@pytest.mark.parametrize(
    "text, value", [("1e4", 10_000), ("1.0e6", 1_000_000), ("1.0e+6", 1_000_000), ("2E5", 200_000), ("'5000'", 5000)]
)
def test_integer_keys_accept_whole_numbers_in_exponent_notation(text, value):
    total_steps = load_config(None, [f"train.total_steps={text}"]).train.total_steps
    assert total_steps == value and type(total_steps) is int


@pytest.mark.parametrize("text", ["1.5", "1e4.5", "1.5e0", ".inf", ".nan", "1e", "true"])
def test_integer_keys_reject_what_is_not_a_whole_number(text):
    with pytest.raises(UserError, match="'train.seed' must be int"):
        load_config(None, [f"train.seed={text}"])


@pytest.mark.parametrize(
    "override, message",
    [
        ("dist.timeout_s=1e300", "'dist.timeout_s' = 1e+300 is out of range; it must be <= 604800.0"),
        (
            "train.total_steps=1e30",
            "'train.total_steps' = 1000000000000000019884624838656 is out of range; it must be <= 1000000000000",
        ),
        ("buffer.capacity=1e12", "'buffer.capacity' = 1000000000000 is out of range; it must be <= 1000000000"),
        ("train.seed=1e20", "'train.seed' = 100000000000000000000 is out of range"),
    ],
)
def test_absurd_sizes_and_times_are_out_of_range(override, message):
    with pytest.raises(UserError, match=re.escape(message)):
        load_config(None, [override])


def test_list_items_are_range_checked_by_item_min():
    from spmd_rl.config.loading import _check_value
    from spmd_rl.config.sections import knob

    widths = knob(None, "hidden layer widths", item_min=1, factory=list).metadata
    assert _check_value("policy.hidden_sizes", [64, 64], list[int], widths) == [64, 64]
    assert _check_value("policy.hidden_sizes", [], list[int], widths) == []
    for value, bad in (([0], r"\[0\]' = 0"), ([64, -3], r"\[1\]' = -3")):
        with pytest.raises(UserError, match=rf"'policy.hidden_sizes{bad} is out of range; it must be >= 1"):
            _check_value("policy.hidden_sizes", value, list[int], widths)


def test_check_memory_names_the_key_when_a_plan_cannot_fit():
    from spmd_rl.runtime.limits import available_memory, check_memory

    assert available_memory() > 2**20
    check_memory(2**20, "the replay buffer of rank 0", "buffer.capacity")
    with pytest.raises(
        UserError,
        match=r"the replay buffer of rank 0 needs 931322574.6 GiB of memory but this "
        r"host has .* available; lower buffer.capacity",
    ):
        check_memory(10**18, "the replay buffer of rank 0", "buffer.capacity")


@pytest.mark.parametrize(
    "env, rank",
    [
        ({}, None),
        ({"RANK": "0"}, 0),
        ({"RANK": "3", "SLURM_PROCID": "0"}, 3),
        ({"OMPI_COMM_WORLD_RANK": "2", "SLURM_PROCID": "0"}, 2),
        ({"PMIX_RANK": "5"}, 5),
        ({"PMI_RANK": "1"}, 1),
        ({"SLURM_PROCID": "4"}, 4),
        ({"RANK": "x"}, None),
    ],
)
def test_the_rank_a_launcher_announced_is_read_without_starting_anything(env, rank):
    from spmd_rl.runtime.launch import rank_from_env

    assert rank_from_env(env) == rank


def test_a_plugin_config_field_of_a_type_a_config_cannot_check_is_a_user_error(tmp_path, monkeypatch):
    (tmp_path / "bare_list_algo.py").write_text(
        "from dataclasses import dataclass\n"
        "from spmd_rl.algorithms.configs import PPOConfig\n"
        "from spmd_rl.algorithms.ppo import PPO\n"
        "from spmd_rl.api import knob\n\n"
        "@dataclass\n"
        "class Config(PPOConfig):\n"
        "    sizes: list = knob(None, 'sizes', factory=list)\n\n"
        "class BareList(PPO):\n"
        "    Config = Config\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_config(None, ["algo.class=bare_list_algo:BareList"]).algo.sizes == []  # its default is fine
    with pytest.raises(UserError, match=r"config key 'algo.sizes' .* is declared as list, which a config cannot check"):
        load_config(None, ["algo.class=bare_list_algo:BareList", "algo.sizes=[1,2]"])


def test_default_policy_declared_as_a_config_key_is_a_user_error(tmp_path, monkeypatch):
    (tmp_path / "keyed_default.py").write_text(
        "from dataclasses import dataclass\n"
        "from spmd_rl.algorithms.configs import PPOConfig\n"
        "from spmd_rl.algorithms.ppo import PPO\n\n"
        "@dataclass\n"
        "class Config(PPOConfig):\n"
        "    default_policy: str = 'actor_critic'\n\n"
        "class KeyedDefault(PPO):\n"
        "    Config = Config\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(UserError, match=r"declares default_policy as a config key .* ClassVar\[str\]"):
        load_config(None, ["algo.class=keyed_default:KeyedDefault"])


@pytest.mark.parametrize("override", ["env.kwargs={chunk:4}", "env.kwargs={render_mode: rgb_array, chunk:4}"])
def test_a_colon_without_a_space_in_an_override_gets_a_hint(override):
    with pytest.raises(UserError) as caught:
        load_config(None, [override])
    assert str(caught.value) == (
        f"override '{override}': YAML reads 'chunk:4' as one key with no value (a colon needs a space after it); "
        "write chunk: 4, e.g. env.kwargs={chunk: 4}"
    )


def test_a_colon_without_a_space_in_a_config_file_gets_the_same_hint(tmp_path):
    # in a file the glued key reached the env as a keyword argument 'chunk:4' (exit 2 from gymnasium's TypeError)
    path = tmp_path / "glued.yaml"
    path.write_text("env:\n  id: CartPole-v1\n  kwargs: {chunk:4}\n")
    with pytest.raises(UserError) as caught:
        load_config(path)
    assert str(caught.value) == (
        f"config file {path}: YAML reads 'chunk:4' as one key with no value (a colon needs a space after it); "
        "write chunk: 4"
    )


def test_a_start_method_without_async_workers_is_refused():
    with pytest.raises(
        UserError, match="env.start_method=spawn says how async env workers start, but env.vectorization=sync"
    ):
        load_config(None, ["env.start_method=spawn", "env.vectorization=sync"])
    assert load_config(None, ["env.start_method=spawn", "env.vectorization=async"]).env.start_method == "spawn"
