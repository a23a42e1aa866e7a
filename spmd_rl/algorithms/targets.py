"""Target networks of the off-policy learners (DQN, SAC's and TD3's critics, TD3's actor): the copy a learner
bootstraps from, and the tensors its Polyak or hard updates read and write."""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

from spmd_rl.comm.sharding import ModuleT, is_dtensor


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
