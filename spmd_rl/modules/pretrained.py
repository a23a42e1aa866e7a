"""A transformers model folder on local disk, read without transformers' loader: its config.json, and its weights
from `model.safetensors` or the shards a `model.safetensors.index.json` names, copied into a module tensor by
tensor (the safetensors library maps each file and reads one tensor at a time, so the file is never in memory
beside the module). Nothing is fetched from a hub.

Before a byte is copied, every tensor's name, shape and dtype (read from the files' headers) is checked against
the module: missing and unexpected keys, shape and dtype mismatches are one UserError naming them. A file's own
names are mapped onto the module's by the caller's `rename` (checkpoint layouts differ from module layouts).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn

from spmd_rl.config.excerpts import clip, listed
from spmd_rl.persist.fileio import file_kind
from spmd_rl.persist.tensor_fit import fit_problems
from spmd_rl.runtime.errors import UserError

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# safetensors' dtype names (a file header's), as torch dtypes
SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


# Where a module's tensor is read from: a safetensors file and the tensor's name in it.
WeightSource = tuple[Path, str]

_deferred = False  # reading_deferred() is in force: load_weights checks the files and reads no tensor


@contextlib.contextmanager
def reading_deferred() -> Iterator[None]:
    """Within it, load_weights checks the files against the module as always but copies no tensor: the tensors it
    would read are zeros. For sharded trainers, each of which then reads only its own rows (read_rows) of what
    load_weights returned, after sharding, instead of one trainer reading them all and sending each its rows."""
    global _deferred
    before, _deferred = _deferred, True
    try:
        yield
    finally:
        _deferred = before


def read_rows(source: WeightSource, start: int, stop: int) -> torch.Tensor:
    """Rows [start, stop) along dim 0 of a file's tensor, read alone (a 0-d tensor whole). Read after the checks
    before start read the file's header: a file damaged or replaced since is a UserError naming it, not a
    traceback on every trainer."""
    from safetensors import SafetensorError, safe_open

    file, name = source
    try:
        with safe_open(file, framework="pt") as handle:
            view = handle.get_slice(name)
            return view[start:stop] if view.get_shape() else handle.get_tensor(name)
    except (SafetensorError, OSError) as exc:
        raise UserError(
            f"policy.pretrained: {file} cannot be read as a safetensors file (it changed after the checks before "
            f"start read it): {clip(str(exc))}; restore the folder, and leave it unchanged while a run reads it"
        ) from None


def read_json(file: Path, what: str) -> dict:
    try:
        value = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"{what} {file} cannot be read as JSON: {clip(str(exc))}") from None
    if not isinstance(value, dict):
        raise UserError(f"{what} {file} must hold a JSON object, not {type(value).__name__}")
    return value


def read_model_config(folder: Path) -> dict:
    """The folder's config.json as a dict; a missing folder or file is a UserError saying what the folder needs."""
    if not folder.is_dir():
        raise UserError(
            f"policy.pretrained={clip(str(folder))} is not a folder; give a local transformers model folder"
        )
    if not (folder / CONFIG_FILE).is_file():
        raise UserError(
            f"policy.pretrained={clip(str(folder))} holds no {CONFIG_FILE}; give a folder written by "
            f"save_pretrained (config.json beside its safetensors files)"
        )
    return read_json(folder / CONFIG_FILE, "policy.pretrained:")


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files holding the folder's weights: the shards its index names (each must exist), or the one
    model.safetensors."""
    index = folder / INDEX_FILE
    if index.is_file():
        weight_map = read_json(index, "policy.pretrained:").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise UserError(f"policy.pretrained: {index} has no 'weight_map' of tensor names to files")
        files = [folder / name for name in dict.fromkeys(weight_map.values())]
        absent = [file.name for file in files if not file.is_file()]
        if absent:
            others = [file for file in files if file.name in absent and file.exists()]  # a FIFO, a device
            what = f"{others[0].name} is {file_kind(others[0].stat().st_mode)}" if others else ""
            raise UserError(
                f"policy.pretrained: {index} names {len(absent)} file(s) that are not regular files in the folder: "
                f"{listed(absent)}{f' ({what})' if what else ''}; copy the whole folder"
            )
        return files
    if (folder / SINGLE_FILE).is_file():
        return [folder / SINGLE_FILE]
    raise UserError(f"policy.pretrained={clip(str(folder))} holds neither {SINGLE_FILE} nor {INDEX_FILE}")


def _headers(files: list[Path]) -> dict[str, tuple[Path, tuple[int, ...], torch.dtype | str]]:
    """{name: (file, shape, dtype)} from the files' headers (no tensor read)."""
    from safetensors import SafetensorError, safe_open

    found = {}
    for file in files:
        try:
            with safe_open(file, framework="pt") as handle:
                for name in handle.keys():
                    view = handle.get_slice(name)
                    dtype = view.get_dtype()
                    found[name] = (file, tuple(view.get_shape()), SAFETENSORS_DTYPES.get(dtype, dtype))
        except (SafetensorError, OSError) as exc:
            raise UserError(
                f"policy.pretrained: {file} cannot be read as a safetensors file: {clip(str(exc))}"
            ) from None
    return found


def load_weights(
    module: nn.Module,
    folder: Path,
    rename: Callable[[str], str | None],
    file_dtype: torch.dtype,
) -> dict[str, WeightSource]:
    """Copy the folder's weights into `module` (the module's own dtype; floating tensors are cast), after checking
    that they fit it: every persistent tensor of the module (one name of each set of tied ones) is in the files
    exactly once, under `rename(file name)` (None: a tensor the module deliberately does not build), with the
    module's shape and `file_dtype` (the dtype the folder's config declares). Returns where each of the module's
    tensors (by its state_dict name) is in the files; a module on the meta device is only checked, and within
    reading_deferred() the tensors are zeros."""
    headers = _headers(weight_files(folder))
    targets = module.state_dict(keep_vars=True)
    mapped: dict[str, tuple[str, Path, tuple, object]] = {}  # module name -> (file name, file, shape, dtype)
    unexpected = []
    for name, (file, shape, dtype) in headers.items():
        target = rename(name)
        if target is None:
            continue
        if target not in targets:
            unexpected.append(name)
        else:
            mapped[target] = (name, file, shape, dtype)
    tied: dict[int, list[str]] = {}  # one entry per distinct tensor: its names in the module
    for name, tensor in targets.items():
        tied.setdefault(id(tensor), []).append(name)
    missing = [names[0] for names in tied.values() if not any(n in mapped for n in names)]
    shapes = [
        f"{source} {shape} (the policy's {tuple(targets[target].shape)})"
        for target, (source, _, shape, _) in mapped.items()
        if shape != tuple(targets[target].shape)
    ]
    dtypes = [
        f"{source} {str(dtype).replace('torch.', '')} (config.json declares {str(file_dtype).replace('torch.', '')})"
        for target, (source, _, _, dtype) in mapped.items()
        if dtype != (file_dtype if targets[target].is_floating_point() else targets[target].dtype)
    ]
    problems = fit_problems(missing, unexpected, shapes, dtypes, "tensor", "the files")
    if problems:
        raise UserError(
            f"policy.pretrained={clip(str(folder))}: its weights do not fit the model: {'; '.join(problems)}"
        )
    sources = {target: (file, source) for target, (source, file, _, _) in mapped.items()}
    if any(tensor.is_meta for tensor in targets.values()):
        return sources  # an instance on the meta device (the checks'): checked against the files, nothing to copy into
    if _deferred:
        with torch.no_grad():
            for target in mapped:
                targets[target].zero_()
        return sources
    _copy(targets, mapped)
    return sources


def _copy(targets: dict, mapped: dict) -> None:
    from safetensors import safe_open

    by_file: dict[Path, list[tuple[str, str]]] = {}
    for target, (source, file, _, _) in mapped.items():
        by_file.setdefault(file, []).append((source, target))
    with torch.no_grad():
        for file, pairs in by_file.items():
            with safe_open(file, framework="pt") as handle:
                for source, target in pairs:
                    targets[target].copy_(handle.get_tensor(source))
