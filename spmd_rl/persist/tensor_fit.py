"""What does not fit when saved tensors are loaded into a policy: missing and unexpected names, shape and dtype
mismatches, as the parts of one error line. Both checks that read someone else's weights build it: `run.init_from`'s
(run/state_fit.py, a state dict against the policy) and `policy.pretrained`'s (modules/pretrained.py, a model
folder's safetensors headers against the module); each finds the names its own way and words the unit and source.
A checkpoint's algorithm state (optimizer moments, critics, targets) is checked against the run's by
state_shape_misfits, in the same words (roles/trainer.py, before a resume loads it)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from spmd_rl.config.excerpts import listed


def shape_misfits(
    expected: Mapping[str, tuple[int, ...]], given: Mapping[str, tuple[int, ...]], owner: str = "the policy's"
) -> list[str]:
    """The parts naming each given shape that differs from the expected one of the same name (fit_problems's
    `shapes`): 'name (given) (the policy's (expected))'; owner names whose the expected shapes are."""
    return [
        f"{key} {given[key]} ({owner} {shape})"
        for key, shape in expected.items()
        if key in given and given[key] != shape
    ]


def state_shape_misfits(expected: Any, stored: Any, optimizers: Mapping[str, Any], prefix: str) -> list[str]:
    """The parts naming each tensor of a saved state (an algorithm's state_dict: nested dicts and lists) whose
    shape differs from the run's own at the same place, named by its path under prefix, and each saved optimizer
    that does not fit. A tensor only one side has is no misfit (an optimizer's moments exist only after its first
    step, a component may add state), nor is one the run holds empty (a replay's rows before any: their count
    grows). An optimizer's state is checked against the optimizer of the same name in `optimizers` (the algorithm's
    attributes): as many parameters, and each moment shaped as its parameter, which torch's load_state_dict does
    not check (a moment of another shape fails at the next step with a traceback, or broadcasts silently)."""
    expected_shapes: dict[str, tuple[int, ...]] = {}
    stored_shapes: dict[str, tuple[int, ...]] = {}
    problems: list[str] = []

    def walk(path: str, mine: Any, saved: Any) -> None:
        if isinstance(saved, torch.Tensor) and isinstance(mine, torch.Tensor):
            if mine.numel():  # an empty one grows with the run (a replay's rows before any): no shape to hold to
                expected_shapes[path], stored_shapes[path] = tuple(mine.shape), tuple(saved.shape)
        elif isinstance(saved, Mapping) and isinstance(mine, Mapping):
            optimizer = optimizers.get(path.rsplit(".", 1)[-1]) if _is_optimizer_state(saved) else None
            if optimizer is not None:
                problems.extend(_optimizer_misfits(path, optimizer, saved, expected_shapes, stored_shapes))
                return
            for key in [key for key in saved if key in mine]:  # the saved order, so the line reads the same
                walk(f"{path}.{key}", mine[key], saved[key])
        elif isinstance(saved, (list, tuple)) and isinstance(mine, (list, tuple)) and len(saved) == len(mine):
            for index, (mine_item, saved_item) in enumerate(zip(mine, saved)):
                walk(f"{path}[{index}]", mine_item, saved_item)

    walk(prefix, expected, stored)
    return problems + shape_misfits(expected_shapes, stored_shapes, "this run's")


def _is_optimizer_state(state: Mapping) -> bool:
    return isinstance(state.get("state"), Mapping) and isinstance(state.get("param_groups"), list)


def _optimizer_misfits(
    path: str,
    optimizer: Any,
    saved: Mapping,
    expected_shapes: dict[str, tuple[int, ...]],
    stored_shapes: dict[str, tuple[int, ...]],
) -> list[str]:
    """An optimizer's saved state against the run's optimizer: a part when their parameter counts differ, else each
    moment's shape (a tensor of one or more dimensions) into the shape tables, expected as its parameter's."""
    params = [tuple(param.shape) for group in optimizer.param_groups for param in group["params"]]
    saved_groups = [list(group.get("params", [])) for group in saved["param_groups"] if isinstance(group, Mapping)]
    saved_ids = [index for group in saved_groups for index in group]
    mine_groups = [len(group["params"]) for group in optimizer.param_groups]
    if [len(group) for group in saved_groups] != mine_groups:
        return [
            f"{path} holds {len(saved_groups)} parameter group(s) of {[len(g) for g in saved_groups]} parameter(s) "
            f"(this run's {len(mine_groups)} of {mine_groups})"
        ]
    position = {index: at for at, index in enumerate(saved_ids)}
    for index, moments in saved["state"].items():
        if index not in position or not isinstance(moments, Mapping):
            continue
        for name, value in moments.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                where = f"{path}.state.{index}.{name}"
                expected_shapes[where], stored_shapes[where] = params[position[index]], tuple(value.shape)
    return []


def fit_problems(
    missing: list[str],
    unexpected: list[str],
    shapes: list[str],
    dtypes: list[str],
    unit: str,
    source: str,
    dtype_advice: str = "",
) -> list[str]:
    """One part per kind of misfit that occurred (none: it fits). unit names what is counted ('key', 'tensor'),
    source where the unexpected ones come from ('the file'); dtype_advice follows the dtype count."""
    problems = []
    if missing:
        problems.append(f"missing {len(missing)} {unit}(s) the policy has: {listed(missing)}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected {unit}(s) of {source}: {listed(unexpected)}")
    if shapes:
        problems.append(f"{len(shapes)} shape mismatch(es): {listed(shapes)}")
    if dtypes:
        problems.append(f"{len(dtypes)} dtype mismatch(es){dtype_advice}: {listed(dtypes)}")
    return problems
