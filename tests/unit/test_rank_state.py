"""What one rank's checkpoint holds (persist/rank_state.py): each component's state under its name, restored into
the components that are there, earlier flat checkpoints regrouped, and names of a user's own checked."""

from __future__ import annotations

import pytest
import torch

from spmd_rl.persist.checkpoint import capture_rng_state
from spmd_rl.persist.rank_state import capture, check_names, in_component_layout, restore
from spmd_rl.runtime.errors import UserError


class Box:
    def __init__(self, value=0):
        self.value = value

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = state["value"]


def test_restore_loads_what_capture_saved_and_leaves_a_component_the_checkpoint_lacks_as_built():
    state = {**capture({"trainer": Box(3), "mine": Box(5)}), "iteration": 7, "rng": capture_rng_state()}
    expected = torch.rand(3)
    components = {"trainer": Box(), "mine": Box(), "added_since": Box(9)}
    torch.rand(5)  # the generators move on; restore sets them back last
    restore(components, state)
    assert [c.value for c in components.values()] == [3, 5, 9]
    assert torch.equal(torch.rand(3), expected)


def test_a_flat_checkpoint_is_regrouped_by_component_and_a_named_one_is_kept():
    flat = {
        "policy": {"w": 1},
        "algorithm": {"step": 2},
        "experience_rows": -1,
        "metrics": {"episodes": 4},
        "env": None,
        "worker": {"steps_taken": 5},
        "recurrent_state": {"h": 6},
        "iteration": 7,
        "rng": {},
        "hooked": 8,
    }
    named = in_component_layout(flat)
    assert named == {
        "trainer": {"policy": {"w": 1}, "algorithm": {"step": 2}, "experience_rows": -1},
        "report": {"episodes": 4},
        "env_runner": {"env": None, "worker": {"steps_taken": 5}},
        "inference_server": {"recurrent_state": {"h": 6}},
        "iteration": 7,
        "rng": {},
        "hooked": 8,
    }
    assert in_component_layout(named) == named


@pytest.mark.parametrize("name", ["trainer", "rng", "metrics", ""])
def test_an_engines_component_may_not_take_a_name_the_run_uses(name):
    with pytest.raises(UserError, match="give each of your components another name"):
        check_names({name: Box()}, "engine.class my:Engine")
    check_names({"mine": Box()}, "engine.class my:Engine")
