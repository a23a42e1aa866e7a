"""How a policy is laid out over the trainers: FSDP2 sharding (`train.parallel: fsdp`), bfloat16 compute
(`train.precision: bf16`) and activation checkpointing, applied to the user's module in one place so that an
algorithm never carries FSDP code of its own (it calls `Context.data_parallel`).

- Shard units: `policy.shard_units()` when the Policy defines it (a transformer's blocks), otherwise the policy's
  direct children that hold parameters. Each unit gets its own `fully_shard` (its parameters are all-gathered just
  for its own forward and backward), then the root gets one for whatever parameters are left.
- The methods an algorithm calls on the policy besides forward (evaluate, value, act ...) are registered with FSDP,
  so they all-gather the parameters like forward does. Every trainer calls them the same number of times in the
  same order (the algorithm's code runs alike on every trainer), which is what FSDP's collectives need.
- bf16: matmuls and convolutions run in bfloat16 under torch.autocast; FSDP also keeps a bf16 copy of the
  parameters for its all-gathers (MixedPrecisionPolicy), while the sharded master weights, the optimizer state
  and the gradient reduce-scatter stay float32. The floating outputs of every registered method are cast back to
  float32, so the algorithm's loss math (ratios, advantages, value targets) is float32.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, TypeGuard, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

if TYPE_CHECKING:  # annotations only: torch.distributed.tensor is imported when a run shards
    from torch.distributed.tensor import DTensor

# shard_policy (and Context.shard) lay a module out in place: what they return is the module they were given.
ModuleT = TypeVar("ModuleT", bound=nn.Module)

BF16 = torch.bfloat16


def is_dtensor(value: Any) -> TypeGuard[DTensor]:
    """A DTensor (a sharded parameter or optimizer state), without importing torch.distributed.tensor eagerly."""
    return type(value).__name__ == "DTensor" and hasattr(value, "full_tensor")


def shard_units(module: nn.Module) -> list[nn.Module]:
    """The submodules that get a fully_shard (and activation checkpointing) of their own."""
    named = getattr(module, "shard_units", None)
    if callable(named):
        return list(named())
    return _children_with_parameters(module)


def _children_with_parameters(module: nn.Module) -> list[nn.Module]:
    """The direct children holding parameters; a container (ModuleList, ModuleDict: no forward) by its own."""
    units = []
    for child in module.children():
        if not any(True for _ in child.parameters()):
            continue
        if isinstance(child, (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)):
            units += _children_with_parameters(child)
        else:
            units.append(child)
    return units


def to_float32(value):
    """value with its floating tensors (also inside tuples, lists, dicts and TensorDicts) in float32."""
    if isinstance(value, torch.Tensor):
        return value.float() if value.is_floating_point() else value
    if isinstance(value, tuple):
        return tuple(to_float32(v) for v in value)
    if isinstance(value, list):
        return [to_float32(v) for v in value]
    if isinstance(value, dict):
        return {k: to_float32(v) for k, v in value.items()}
    if hasattr(value, "batch_size") and hasattr(value, "apply"):  # a TensorDict
        return value.apply(lambda t: t.float() if t.is_floating_point() else t)
    return value


def in_bf16(method: Callable, device_type: str) -> Callable:
    """method run under bfloat16 autocast, its floating outputs returned in float32."""

    @functools.wraps(method)
    def run(*args, **kwargs):
        with torch.autocast(device_type, dtype=BF16):
            out = method(*args, **kwargs)
        return to_float32(out)

    return run


def compute_in_bf16(module: nn.Module, methods: Iterable[str], device_type: str) -> None:
    """Patch this instance's forward and the named methods to compute in bf16 (its class is untouched)."""
    for name in dict.fromkeys(["forward", *methods]):
        if callable(getattr(module, name, None)):
            setattr(module, name, in_bf16(getattr(module, name), device_type))


def checkpoint_activations(units: list[nn.Module]) -> None:
    """Recompute each unit's activations in backward instead of keeping them (non-reentrant checkpointing).
    The unit's forward is patched on the instance, so parameter names (and checkpoints) are unchanged."""
    for unit in units:
        forward = unit.forward
        unit.forward = functools.partial(checkpoint, forward, use_reentrant=False)


def cast_parameters(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """The module's floating-point parameters in dtype, in place (buffers such as normalizer statistics keep
    theirs: they are read in float32/float64 math)."""
    for param in module.parameters():
        if param.is_floating_point():
            param.data = param.data.to(dtype)
    return module


# The trainer group of every mesh made here: the group a sharded checkpoint is written and read by (a 2-D mesh's
# own groups are per dimension).
_TRAINERS_OF_MESH: dict[int, dist.ProcessGroup] = {}


def trainer_mesh(group: dist.ProcessGroup, device: torch.device, hybrid=None):
    """The device mesh FSDP shards over: the trainer group (1-D), or with hybrid sharding a 2-D mesh
    (replicate, shard) from `hybrid` = (replicate group, shard group, [[global ranks]] per replica)."""
    from torch.distributed.device_mesh import DeviceMesh

    if hybrid is None:
        mesh = DeviceMesh.from_group(group, device.type)
    else:
        replicate, shard, ranks = hybrid
        mesh = DeviceMesh.from_group(
            [replicate, shard], device.type, mesh=torch.tensor(ranks), mesh_dim_names=("replicate", "shard")
        )
    _TRAINERS_OF_MESH[id(mesh)] = group
    return mesh


def mesh_trainers(mesh) -> dist.ProcessGroup:
    """The trainer group of a mesh made by trainer_mesh (a 1-D mesh's own group otherwise)."""
    return _TRAINERS_OF_MESH.get(id(mesh)) or mesh.get_group()


def shard_policy(
    module: ModuleT,
    group: dist.ProcessGroup,
    device: torch.device,
    methods: Iterable[str],
    bf16: bool,
    hybrid=None,
) -> ModuleT:
    """FSDP2 over group (or, with hybrid, sharded within and replicated across its groups: see trainer_mesh): one
    fully_shard per shard unit, then the root; methods registered as forward methods. Returns the module itself
    (fully_shard works in place and keeps parameter names)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    # FSDP2 warns of every view a wrapped module returns (in-place ops on one would skip a hook); the built-in
    # policies return views (slices, squeezes) and never modify them in place.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    mesh = trainer_mesh(group, device, hybrid)
    # cast_forward_inputs off: observations enter in their own dtype (normalizer math in float32); autocast
    # casts them at each matmul. The parameters FSDP all-gathers are bf16 copies; gradients reduce in float32.
    precision = (
        MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=torch.float32, cast_forward_inputs=False)
        if bf16
        else MixedPrecisionPolicy()
    )
    for unit in shard_units(module):
        fully_shard(unit, mesh=mesh, mp_policy=precision)
    fully_shard(module, mesh=mesh, mp_policy=precision)
    for name in dict.fromkeys(methods):
        if name != "forward" and callable(getattr(module, name, None)):
            register_fsdp_forward_method(module, name)
    return module


def reshard(module: nn.Module) -> None:
    """Free the parameters FSDP all-gathered for module's last forward and still holds, registering its shards as
    its parameters again (nothing for a module not sharded): the root's are kept after a forward for the backward it
    expects, and a forward without grad has none to free them. Needed around writing values into the shards (a
    reference policy's swapped in and out), which a held gather would not show."""
    for sub in module.modules():
        # fully_shard gives a module a class deriving from FSDPModule; by name, so that a run that does not shard
        # never imports FSDP
        if any(cls.__name__ == "FSDPModule" for cls in type(sub).__mro__):
            sub.reshard()  # type: ignore[operator]  # FSDPModule.reshard


def single_process_group(device: torch.device) -> dist.ProcessGroup:
    """The world group of a one-process run, created on first use (FSDP over one trainer still needs one: its
    checkpoints are the same sharded files as with several). NCCL for CUDA tensors, as in launched runs."""
    if not dist.is_initialized():
        backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    world = dist.group.WORLD
    assert world is not None  # initialized (above, or before)
    return world


def full_state_dict(module: nn.Module) -> dict[str, Any]:
    """The sharded module's full state dict, gathered tensor by tensor to the CPU of the group's first rank
    (the others get an empty dict). Collective over the module's trainers."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def fill_shards(
    module: nn.Module,
    source: dict[str, torch.Tensor] | None,
    group: dist.ProcessGroup,
    src: int,
    files: dict[str, Callable[[int, int], torch.Tensor]] | None = None,
) -> None:
    """A sharded module materialised on its device (to_empty after fully_shard on the meta device) given the values
    of `source`, trainer `src`'s plain policy of the same class (its every parameter and buffer by name; None on the
    other trainers), tensor by tensor: each broadcast over the trainer group, each trainer keeping its own shard
    (the rows DTensor's own sharding gives it). No trainer but `src` ever holds more than one whole tensor. The
    tensors `files` names (the same on every trainer) are not sent: each trainer reads its own rows of them,
    files[name](start, stop) giving rows [start, stop) along dim 0 (from a Policy's file_sources). Collective over
    the group, in the module's own order of names (the same on every trainer)."""
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    files = files or {}
    named = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    read = {id(target) for name, target in named if name in files}  # tied names of a read tensor: not sent either
    with torch.no_grad():
        for name, target in named:
            if name in files:
                local, start = target, 0
                if is_dtensor(target):  # the rows this trainer holds, as DCP reckons them
                    shape, offset = compute_local_shape_and_global_offset(
                        target.shape, target.device_mesh, target.placements
                    )
                    local, start = target.to_local(), offset[0]
                    assert shape[1:] == tuple(target.shape[1:]), f"{name}: sharded along dim 0 alone"
                if local.numel():
                    rows = files[name](start, start + (local.shape[0] if local.dim() else 1))
                    local.copy_(rows.to(dtype=local.dtype).reshape(local.shape))
                continue
            if id(target) in read:
                continue
            if is_dtensor(target):
                whole = source[name] if source is not None else torch.empty(target.shape, dtype=target.dtype)
            else:
                whole = source[name] if source is not None else torch.empty_like(target, device="cpu")
            whole = whole.detach().to(device=target.device, dtype=target.dtype).contiguous()
            dist.broadcast(whole, src=src, group=group)
            if is_dtensor(target):
                # src_data_rank None: every rank takes its own rows from the whole tensor it holds, no communication
                own = distribute_tensor(whole, target.device_mesh, target.placements, src_data_rank=None)
                target.to_local().copy_(own.to_local())
            else:
                target.copy_(whole)
