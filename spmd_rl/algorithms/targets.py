"""Target networks of the off-policy learners (DQN, SAC's and TD3's critics, TD3's actor): the copy a learner
bootstraps from, and the tensors its Polyak or hard updates read and write; and GRPO's reference policy, kept as
values of the policy's own trainable parameters and swapped into the policy for its forward."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from spmd_rl.comm.sharding import ModuleT, is_dtensor, reshard


@torch.no_grad()
def own_storage(module: ModuleT) -> ModuleT:
    """module with every parameter and buffer in a storage of its own. A deep copy keeps the sharing of the
    original, whose tensors may be views into one flat weight-sync bucket of mixed dtypes (split layouts), which
    torch.save refuses for a state dict of its own."""
    for sub in module.modules():
        for name, param in sub._parameters.items():
            if param is not None:
                sub._parameters[name] = nn.Parameter(param.detach().clone(), requires_grad=param.requires_grad)
        for name, buffer in sub._buffers.items():
            if buffer is not None:
                sub._buffers[name] = buffer.clone()
    return module


def target_copy(module: ModuleT) -> ModuleT:
    """A frozen copy of module, in storage of its own: the target network that learns only by updates."""
    return own_storage(copy.deepcopy(module)).requires_grad_(False)


def local_view(tensor: Tensor) -> Tensor:
    """This process's part of a tensor: its shard of a DTensor (the same storage), the tensor itself otherwise."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


@torch.no_grad()
def trainable_values(module: nn.Module) -> dict[str, Tensor]:
    """A copy of the values of module's trainable parameters by name, each as this process holds it: a DTensor of
    its own shard under fsdp (no more of it), the whole tensor otherwise. Frozen parameters (a LoRA base) never
    change, so a copy of them would only repeat them."""
    reshard(module)  # the sharded parameters, not a gather a forward left registered
    return {name: param.detach().clone() for name, param in module.named_parameters() if param.requires_grad}


@contextmanager
def values_swapped(module: nn.Module, values: dict[str, Tensor]) -> Iterator[None]:
    """Within the block, module's parameters named in `values` hold those values and `values` holds theirs; after
    it, each is back (exchanged in place, shard by shard, bit for bit, one tensor's copy at a time; without grad, so
    autograd and the optimizer state, keyed by the parameters themselves, see nothing). A sharded module is
    resharded on both sides of the block: FSDP keeps the root's parameters all-gathered after a forward without
    grad (an act), registered in place of the shards, and its next forward would read that gather, not the values
    now in the shards."""
    with torch.no_grad():
        reshard(module)
        params = dict(module.named_parameters())  # the sharded parameters, once resharded
        pairs = [(local_view(params[name]), local_view(value)) for name, value in values.items()]
        _exchange(pairs)
        try:
            yield
        finally:
            _exchange(pairs)
            reshard(module)


def _exchange(pairs: list[tuple[Tensor, Tensor]]) -> None:
    for first, second in pairs:
        held = first.clone()
        first.copy_(second)
        second.copy_(held)
