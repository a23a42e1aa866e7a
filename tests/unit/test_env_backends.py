"""Env backends as plug-ins (spmd_rl/envs/backend.py): env.backend names a class that probes, makes, limits and
saves a rank's envs, and no file outside envs/backends/ tests a backend's name."""

from __future__ import annotations

import ast
import sys
import textwrap
from pathlib import Path

import pytest

from spmd_rl.config import plugins
from spmd_rl.config.loading import load_config
from spmd_rl.envs.backend import backend_for
from spmd_rl.envs.vector import make_vector_env, probe_env
from spmd_rl.run.evaluation import episode_step_limit, evaluate
from spmd_rl.runtime.errors import UserError

PACKAGE = Path(__file__).resolve().parents[2] / "spmd_rl"

USER_BACKEND = '''
from spmd_rl.api import EnvBackend
from spmd_rl.envs.backends.gymnasium import GymnasiumBackend

CALLS = []


class Recording(GymnasiumBackend):
    """gymnasium's envs, with a step limit of its own and every call recorded."""

    def probe(self, cfg):
        CALLS.append("probe")
        return super().probe(cfg)

    def make(self, cfg, spec, seed, wrappers=None):
        CALLS.append(("make", cfg.num_envs, len(wrappers or ())))
        return super().make(cfg, spec, seed, wrappers)

    def step_limit(self, cfg):
        return 7

    def unsaved_reason(self, envs):
        return "recording backend: no state"


class OneIdOnly(GymnasiumBackend):
    takes_groups = False
    groups_refusal = "this simulator runs one scene per process"


class NotABackend:
    pass
'''


@pytest.fixture
def user_backends(tmp_path, monkeypatch):
    (tmp_path / "my_backends.py").write_text(textwrap.dedent(USER_BACKEND))
    monkeypatch.chdir(tmp_path)  # a module in the working directory is importable, as for every plug-in
    monkeypatch.delitem(sys.modules, "my_backends", raising=False)
    yield
    sys.modules.pop("my_backends", None)


def test_a_users_backend_probes_makes_and_limits_the_evaluation(user_backends):
    cfg = load_config(None, ["env.backend=my_backends:Recording", "env.num_envs=3"])
    import my_backends

    spec = probe_env(cfg.env)
    envs, obs = make_vector_env(cfg.env, spec, seed=0)
    assert obs.shape == (3, 4)
    assert backend_for(cfg.env).unsaved_reason(envs) == "recording backend: no state"
    envs.close()
    assert episode_step_limit(cfg.env) == 7

    from spmd_rl.run.policies import build_policy

    policy = build_policy(cfg, spec, plugins.load_class(plugins.POLICY, cfg.classes["policy"]))
    my_backends.CALLS.clear()
    result = evaluate(policy, cfg.env, episodes=2, seed=0, deterministic=True)
    # Its own limit (7) is the evaluation's; it is not cut below it, so no TimeLimit of ours is added.
    assert result["max_steps"] == 7 and result["cut"] == 0
    assert my_backends.CALLS == ["probe", ("make", 2, 0)]
    result = evaluate(policy, cfg.env, episodes=2, seed=0, deterministic=True, max_steps=3)
    assert result["max_steps"] == 3 and result["lengths"] == [3, 3] and result["cut"] == 2
    assert my_backends.CALLS[-1] == ("make", 2, 1)  # the backend's limit_steps gave one wrapper


@pytest.mark.parametrize(
    "override, match",
    [
        ("env.backend=nope", r"env.backend 'nope' is neither a built-in env backend \(gymnasium, envpool\)"),
        ("env.backend=my_backends:Missing", "env.backend 'my_backends:Missing': module 'my_backends' has no attribute"),
    ],
)
def test_a_bad_backend_name_is_a_user_error_naming_env_backend(user_backends, override, match):
    with pytest.raises(UserError, match=match):
        cfg = load_config(None, [override])
        probe_env(cfg.env)


def test_a_class_that_is_no_backend_is_refused(user_backends):
    cfg = load_config(None, ["env.backend=my_backends:NotABackend"])
    with pytest.raises(UserError, match=r"must be a subclass of spmd_rl.api.EnvBackend"):
        probe_env(cfg.env)


def test_a_backend_that_takes_no_groups_refuses_them_when_the_config_loads(user_backends):
    with pytest.raises(UserError, match="env.groups needs env.backend=gymnasium: this simulator runs one scene"):
        load_config(None, ["env.backend=my_backends:OneIdOnly", "env.groups=[{name: a}]"])


def _backend_alias_tests(path: Path) -> list[str]:
    """Comparisons against a built-in backend's name (`x == "envpool"`, `x in ("gymnasium", ...)`)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            for part in ast.walk(node):
                if isinstance(part, ast.Constant) and part.value in plugins.ENV_BACKEND.aliases:
                    found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    return found


def test_no_file_outside_the_backends_tests_a_backends_name():
    found = [
        hit
        for path in sorted(PACKAGE.rglob("*.py"))
        if "backends" not in path.parts
        for hit in _backend_alias_tests(path)
    ]
    assert found == []
