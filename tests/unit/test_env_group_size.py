"""env.group_size: blocks of envs that start from the same initial state, within one env rank."""

import numpy as np
import pytest

from spmd_rl.algorithms.ppo import PPO
from spmd_rl.config.loading import load_config
from spmd_rl.config.sections import EnvSection
from spmd_rl.envs.vector import make_vector_env, probe_env
from spmd_rl.run.plan import plan_run
from spmd_rl.run.topology import build_topology
from spmd_rl.runtime.errors import UserError


@pytest.mark.parametrize("env_id", ["CartPole-v1", "Pendulum-v1"])
def test_every_member_of_a_group_starts_from_the_groups_initial_state_and_groups_differ(env_id):
    cfg = EnvSection(id=env_id, num_envs=8, group_size=4)
    spec = probe_env(cfg)
    assert spec.vectorization == "sync"  # CartPole's own vectorized envs share one generator: one env at a time
    envs, obs = make_vector_env(cfg, spec, seed=123)
    envs.close()
    first, second = obs[:4], obs[4:]
    assert (first == first[0]).all() and (second == second[0]).all()
    assert not np.array_equal(first[0], second[0])
    # Without groups every env starts from its own state.
    plain = EnvSection(id=env_id, num_envs=8)
    envs, obs = make_vector_env(plain, probe_env(plain), seed=123)
    envs.close()
    assert len({tuple(row) for row in obs}) == 8


def test_the_groups_of_two_env_ranks_start_from_different_states():
    # Rank r's seed is base + r * num_envs (run.py): the groups' seeds base + r * num_envs + i // G never meet.
    cfg = EnvSection(id="CartPole-v1", num_envs=4, group_size=2)
    spec = probe_env(cfg)
    starts = []
    for rank in range(2):
        envs, obs = make_vector_env(cfg, spec, seed=7 + rank * cfg.num_envs)
        envs.close()
        starts += [tuple(obs[0]), tuple(obs[2])]
    assert len(set(starts)) == 4


def test_a_group_size_that_does_not_divide_an_env_ranks_envs_is_refused_before_any_process_group():
    cfg = load_config(None, ["env.total_envs=12", "env.group_size=4"])
    assert plan_run(cfg, build_topology(cfg.layout, 1), PPO).env.num_envs == 12
    # On 2 ranks each holds 6 envs: a group of 4 would span them.
    with pytest.raises(UserError, match=r"env.group_size=4 does not divide the 6 envs of env on each env rank"):
        plan_run(cfg, build_topology(cfg.layout, 2), PPO)
    groups = load_config(
        None,
        ["env.group_size=4", "env.groups=[{name: a, num_envs: 4}, {name: b, num_envs: 2}]"],
    )
    with pytest.raises(UserError, match=r"does not divide the 2 envs of env.groups\[1\] \('b'\)"):
        plan_run(groups, build_topology(groups.layout, 1), PPO)


def test_an_evaluation_plays_independent_episodes_whatever_env_group_size_says():
    # Fault pass 9: evaluate() kept env.group_size, so a block of envs started alike and (deterministic actions)
    # played one episode G times, and an episode count that is no multiple of G failed the groups' start check,
    # blamed on the env ("were reset with one seed but returned different first observations", exit 4).
    from spmd_rl.config import plugins
    from spmd_rl.run.evaluation import evaluate
    from spmd_rl.run.policies import build_policy

    cfg = load_config(None, ["env.id=Pendulum-v1", "env.num_envs=4", "env.group_size=2"])
    spec = probe_env(cfg.env)
    policy = build_policy(cfg, spec, plugins.load_class(plugins.POLICY, cfg.classes["policy"]))
    result = evaluate(policy, cfg.env, episodes=4, seed=0, deterministic=True, max_steps=5)
    assert len(set(result["returns"])) == 4  # four starts, not two played twice
    assert len(evaluate(policy, cfg.env, episodes=3, seed=0, deterministic=True, max_steps=5)["returns"]) == 3
