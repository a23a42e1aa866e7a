"""The layout -> roles function, for many world sizes, and every impossible layout."""

import pytest

from spmd_rl.config.sections import LayoutSection
from spmd_rl.run.topology import build_topology
from spmd_rl.runtime.errors import UserError


@pytest.mark.parametrize("world", [1, 2, 3, 8, 16])
def test_colocated_every_rank_plays_every_role(world):
    topo = build_topology(LayoutSection(), world)
    assert topo.colocated and topo.trainer_ranks == topo.env_ranks == tuple(range(world))
    assert topo.weight_ranks == ()
    assert all(topo.envs_trained_by(r) == (r,) for r in range(world))


@pytest.mark.parametrize(
    "world, t, i, e",
    [
        (3, 1, 1, 1),
        (4, 1, 1, 2),
        (8, 2, 2, 4),
        (8, 1, 2, -1),
        (8, -1, 1, 4),
        (12, 2, 3, 7),
        (16, 4, 4, 8),
        (5, 1, -1, 3),
    ],
)
def test_split_layouts_are_balanced_and_complete(world, t, i, e):
    topo = build_topology(LayoutSection(mode="split", trainer=t, inference=i, env=e), world)
    ranks = topo.trainer_ranks + topo.inference_ranks + topo.env_ranks
    assert sorted(ranks) == list(range(world)), "every rank has exactly one role"
    assert topo.trainer_ranks[0] == 0, "rank 0 is trainer 0 (it logs and broadcasts)"
    assert topo.weight_ranks == (0,) + topo.inference_ranks
    for table, owners in ((topo.env_to_inference, topo.inference_ranks), (topo.env_to_trainer, topo.trainer_ranks)):
        assert set(table) == set(topo.env_ranks)
        loads = [sum(1 for v in table.values() if v == o) for o in owners]
        assert max(loads) - min(loads) <= 1 and min(loads) >= 1
    assert sum(len(topo.envs_served_by(r)) for r in topo.inference_ranks) == len(topo.env_ranks)
    assert topo.describe(topo.env_ranks[0]) == f"rank {topo.env_ranks[0]} (env 0)"


@pytest.mark.parametrize(
    "world, layout, message",
    [
        (8, dict(trainer=2, inference=2, env=2), "needs 6 ranks but the world size is 8"),
        (8, dict(trainer=0, inference=2, env=6), "at least one trainer rank"),
        (8, dict(trainer=2, inference=6, env=0), "at least one env rank"),
        (8, dict(trainer=2, inference=0, env=6), "at least one inference rank"),
        (8, dict(trainer=1, inference=4, env=3), "more inference ranks than env ranks"),
        (8, dict(trainer=5, inference=1, env=2), "more trainer ranks than env ranks"),
        (8, dict(trainer=-1, inference=-1, env=4), "only one of"),
        (4, dict(trainer=2, inference=2, env=-1), "at least one env rank"),
        (2, dict(trainer=2, inference=2, env=-1), "needs at least 3 ranks .* and this run has 2: start more ranks"),
        (1, dict(), "needs at least 3 ranks .* and this run has 1: .* or set layout.mode=colocated"),  # not "sum to 1"
    ],
)
def test_impossible_split_layouts_say_what_to_change(world, layout, message):
    with pytest.raises(UserError, match=message):
        build_topology(LayoutSection(mode="split", **layout), world)


def test_colocated_rejects_role_counts():
    with pytest.raises(UserError, match="only applies to layout.mode=split"):
        build_topology(LayoutSection(mode="colocated", trainer=2), 4)
