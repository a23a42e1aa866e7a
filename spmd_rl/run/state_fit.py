"""Loading weights someone else saved into a Policy: a .safetensors file (pretrained models ship in that format),
and the check that a state dict fits the policy (names, shapes, dtypes) with a one-line error naming the keys that
do not, before anything is copied. `run.init_prefix` maps a file's names onto one submodule of the policy."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn

from spmd_rl.config.excerpts import listed
from spmd_rl.persist.tensor_fit import fit_problems, shape_misfits
from spmd_rl.runtime.errors import UserError

SAFETENSORS_SUFFIX = ".safetensors"


def read_safetensors(file: Path) -> dict[str, Tensor]:
    """The file's tensors on the CPU; a damaged or foreign file is a UserError naming it."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(file, device="cpu")
    except (SafetensorError, OSError, ValueError) as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"{file} cannot be read as a safetensors file ({first_line}): is it complete?") from None


def split_prefix(prefix: str) -> tuple[str, str]:
    """(the policy's prefix, the file's prefix) of `run.init_prefix`: 'encoder.' or 'encoder.:backbone.'."""
    target, _, source = prefix.partition(":")
    for part, what in ((target, "policy"), (source, "file")):
        if part and not part.endswith("."):
            raise UserError(
                f"run.init_prefix={prefix}: the {what}'s prefix '{part}' must end with '.' (e.g. "
                f"run.init_prefix=encoder. or encoder.:backbone.)"
            )
    return target, source


def fit_state_dict(policy: nn.Module, state: dict[str, Tensor], prefix: str = "") -> dict[str, Tensor]:
    """state under the policy's names, checked to fit it exactly: every key the policy (or, with a prefix, its
    submodule) has, no other, each of the policy's shape and dtype. Raises a UserError listing what does not fit
    (the caller names the file in front of it).

    With run.init_prefix=T (a policy prefix), file key k is policy key T+k and only the keys under T are required;
    with T:S (and a file prefix), only the file's keys that start with S are read, with S cut off: a part of a
    larger pretrained model goes into one submodule."""
    target, source = split_prefix(prefix)
    if source:
        selected = {key[len(source) :]: value for key, value in state.items() if key.startswith(source)}
        if not selected:
            raise UserError(
                f"no key of the file starts with '{source}' (run.init_prefix); its keys: {listed(list(state))}"
            )
        state = selected
    everything = policy.state_dict()
    expected = {key: value for key, value in everything.items() if key.startswith(target)}
    if not expected:
        tops = list(dict.fromkeys(key.split(".")[0] for key in everything))
        raise UserError(
            f"run.init_prefix={prefix}: the policy has no weights under '{target}' (its top-level names: "
            f"{listed(tops) or 'none'})"
        )
    mapped = {target + key: value for key, value in state.items()}
    missing = [key for key in expected if key not in mapped]
    unexpected = [source + key[len(target) :] for key in mapped if key not in expected]  # the file's own names
    layout = _lora_layout_misfit(missing, unexpected)
    if layout:
        raise UserError(layout)
    shapes, dtypes = _shape_and_dtype_misfits(expected, mapped)
    problems = fit_problems(
        missing, unexpected, shapes, dtypes, "key", "the file", dtype_advice=" (convert the file's tensors)"
    )
    if problems:
        if target or source:  # say how the file's names were read
            problems.append(f"file key {source}K was read as policy key {target}K (run.init_prefix={prefix})")
        raise UserError("; ".join(problems))
    return mapped


_LORA_NAMES = (".base_layer.", ".lora_A.", ".lora_B.")  # how peft's LoRA wraps a layer's weights


def _lora_layout_misfit(missing: list[str], unexpected: list[str]) -> str:
    """One sentence instead of the key lists when the keys that do not fit are LoRA's: the file and the policy differ
    in having LoRA adapters (policy.lora.rank), not in their weights (fault pass 6, V6: 48 keys listed)."""

    def lora(keys: list[str]) -> bool:
        return any(name in key for key in keys for name in _LORA_NAMES)

    counts = f"{len(missing)} key(s) of the policy missing, {len(unexpected)} of the file unexpected"
    if lora(missing) and not lora(unexpected):
        return (
            f"the file holds a policy without LoRA adapters and this policy has them (policy.lora.rank > 0): "
            f"{counts}; the file's layout must match the policy's: start from a LoRA run (its checkpoint, or a "
            f"policy.pt saved with policy.lora.save=adapters), or set policy.lora.rank=0"
        )
    if lora(unexpected) and not lora(missing):
        return (
            f"the file holds a policy with LoRA adapters (saved with policy.lora.save=adapters) and this policy has "
            f"none: {counts}; the file's layout must match the policy's: set policy.lora.rank to the file's run's, or "
            f"start from a policy.pt saved with policy.lora.save=merged"
        )
    return ""


def _shape_and_dtype_misfits(expected: dict[str, Tensor], given: dict[str, Tensor]) -> tuple[list[str], list[str]]:
    """(the shape mismatches, the dtype mismatches) of the given tensors that share a name with expected ones."""
    shapes = shape_misfits(_shapes(expected), _shapes(given))
    dtypes = [
        f"{key} {given[key].dtype} (the policy's {value.dtype})"
        for key, value in expected.items()
        if key in given and given[key].shape == value.shape and given[key].dtype != value.dtype
    ]
    return shapes, dtypes


def _shapes(tensors: dict[str, Tensor]) -> dict[str, tuple[int, ...]]:
    return {key: tuple(value.shape) for key, value in tensors.items()}


def module_tensors(module: nn.Module) -> dict[str, Tensor]:
    """The module's parameters and persistent buffers by their own names: its state_dict before any state-dict hook
    lays it out otherwise."""
    tensors: dict[str, Tensor] = dict(module.named_parameters())
    for name, buffer in module.named_buffers():
        owner, _, leaf = name.rpartition(".")
        if leaf not in module.get_submodule(owner)._non_persistent_buffers_set:
            tensors[name] = buffer
    return tensors


def in_state_dict_layout(policy: nn.Module, state: dict[str, Tensor]) -> dict[str, Tensor]:
    """state in the policy's state_dict layout. A sharded checkpoint (train.parallel=fsdp) holds the policy's
    tensors as the module holds them, by parameter name, since its shards are saved as they lie; a policy whose
    state_dict is a layout of its own (ActorCritic writes its packed actor-critic pair as two MLPs) is given such
    a state through its module and read back in its state_dict layout. Any other state is returned as it is (the
    fit check names what does not fit); a module-layout state of other shapes or dtypes is a UserError naming them."""
    if set(state) == set(policy.state_dict()):
        return state
    own = module_tensors(policy)
    if set(state) != set(own):
        return state
    shapes, dtypes = _shape_and_dtype_misfits(own, state)
    problems = fit_problems([], [], shapes, dtypes, "tensor", "the file", dtype_advice=" (convert the file's tensors)")
    if problems:
        raise UserError("; ".join(problems))
    with torch.no_grad():
        policy.load_state_dict(state)
    return policy.state_dict()


def load_fitted(policy: nn.Module, state: dict[str, Tensor], prefix: str = "") -> int:
    """Copy state (in the policy's state_dict layout, or a sharded checkpoint's: see in_state_dict_layout) into the
    policy after fit_state_dict's check; with a policy prefix the rest of the policy keeps its initialization.
    Returns how many tensors were loaded."""
    if not prefix:
        state = in_state_dict_layout(policy, state)
    mapped = fit_state_dict(policy, state, prefix)
    # The whole state, the policy's own values outside the prefix: a policy whose state_dict is a layout of its
    # own (load hooks that need every key, as ActorCritic's packed pair) loads a part as well as the whole.
    whole = policy.state_dict() | mapped
    with torch.no_grad():
        policy.load_state_dict(whole)
    return len(mapped)
