"""A checkpoint's algorithm state against the run's (persist/tensor_fit.state_shape_misfits): each tensor of another
shape named by its path, optimizer moments held to their parameters' shapes (torch's load_state_dict does not check
them), an optimizer of another parameter count named, and nothing said of a state that fits or of state that grows
(a replay's rows)."""

import torch

from spmd_rl.persist.tensor_fit import state_shape_misfits


def _stepped_adam(*shapes: tuple[int, ...]) -> torch.optim.Adam:
    params = [torch.nn.Parameter(torch.ones(shape)) for shape in shapes]
    optimizer = torch.optim.Adam(params)
    for param in params:
        param.grad = torch.ones_like(param)
    optimizer.step()
    return optimizer


def _state(optimizer: torch.optim.Optimizer, critic: torch.Tensor, rows: torch.Tensor) -> dict:
    return {"optimizer": optimizer.state_dict(), "critic": {"weight": critic}, "replay": {"rows": rows}, "steps": 3}


def test_a_state_of_the_same_shapes_fits_and_growing_rows_are_no_misfit():
    mine = torch.optim.Adam([torch.nn.Parameter(torch.ones(4, 3)), torch.nn.Parameter(torch.ones(3))])  # no step yet
    saved = _state(_stepped_adam((4, 3), (3,)), torch.ones(2, 5), torch.ones(7, 2))
    expected = _state(mine, torch.zeros(2, 5), torch.ones(0, 2))
    assert state_shape_misfits(expected, saved, {"optimizer": mine}, "algorithm") == []


def test_moments_and_tensors_of_another_shape_are_named_by_their_path():
    mine = torch.optim.Adam([torch.nn.Parameter(torch.ones(4, 3)), torch.nn.Parameter(torch.ones(3))])
    saved = _state(_stepped_adam((4, 2), (3,)), torch.ones(2, 6), torch.ones(7, 2))
    expected = _state(mine, torch.zeros(2, 5), torch.ones(0, 2))
    misfits = state_shape_misfits(expected, saved, {"optimizer": mine}, "algorithm")
    assert misfits == [
        "algorithm.optimizer.state.0.exp_avg (4, 2) (this run's (4, 3))",
        "algorithm.optimizer.state.0.exp_avg_sq (4, 2) (this run's (4, 3))",
        "algorithm.critic.weight (2, 6) (this run's (2, 5))",
    ]


def test_an_optimizer_of_another_parameter_count_is_named():
    mine = torch.optim.Adam([torch.nn.Parameter(torch.ones(4, 3)), torch.nn.Parameter(torch.ones(3))])
    saved = _state(
        _stepped_adam(
            (4, 3),
        ),
        torch.ones(2, 5),
        torch.ones(7, 2),
    )
    expected = _state(mine, torch.zeros(2, 5), torch.ones(0, 2))
    misfits = state_shape_misfits(expected, saved, {"optimizer": mine}, "algorithm")
    assert misfits == ["algorithm.optimizer holds 1 parameter group(s) of [1] parameter(s) (this run's 1 of [2])"]
