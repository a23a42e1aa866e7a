"""What does not fit when saved tensors are loaded into a policy: missing and unexpected names, shape and dtype
mismatches, as the parts of one error line. Both checks that read someone else's weights build it: `run.init_from`'s
(run/state_fit.py, a state dict against the policy) and `policy.pretrained`'s (modules/pretrained.py, a model
folder's safetensors headers against the module); each finds the names its own way and words the unit and source."""

from __future__ import annotations

from collections.abc import Mapping

from spmd_rl.config.excerpts import listed


def shape_misfits(expected: Mapping[str, tuple[int, ...]], given: Mapping[str, tuple[int, ...]]) -> list[str]:
    """The parts naming each given shape that differs from the expected one of the same name (fit_problems's
    `shapes`): 'name (given) (the policy's (expected))'."""
    return [
        f"{key} {given[key]} (the policy's {shape})"
        for key, shape in expected.items()
        if key in given and given[key] != shape
    ]


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
