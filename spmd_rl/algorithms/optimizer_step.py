"""A fused torch.optim.Adam's step, and the gradient clip before it, without their Python wrappers: on small
networks, stepped once per minibatch, the wrapper (profiler record, hooks, grad mode, grouping the tensors by device
and dtype, gathering the state) costs more than the fused kernel itself.

The kernel, its arguments and the optimizer's state are torch's own: the state is created by Adam's _init_group
on the first step and read back from optimizer.state, so state_dict(), load_state_dict() and checkpoints are
unchanged, and every step's numbers are those of optimizer.step(). Anything but one plain param group of fused
Adam over same-device float32 parameters (or plain tensors, as SAC's temperature) that all have gradients goes
through optimizer.step() as before.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.optim.optimizer as optimizer_module
from torch import nn


class FusedAdamStep:
    """Calls `optimizer.step()` of a fused torch.optim.Adam as the kernel call it ends in. The state's tensors are
    looked up again after load_state_dict, which replaces the optimizer's state dict (a checkpoint's resume)."""

    def __init__(self, optimizer: torch.optim.Adam):
        self.optimizer = optimizer
        self.state_lists: tuple[list, list, list] | None = None  # (exp_avgs, exp_avg_sqs, steps)
        self.gathered_from: dict | None = None  # the optimizer.state the lists were read from

    def __call__(self) -> None:
        optimizer = self.optimizer
        group = optimizer.param_groups[0]
        params = group["params"]
        grads = [p.grad for p in params]
        if optimizer.state is not self.gathered_from:
            self.state_lists = None
        if self.state_lists is None and not self._gather_state(group, grads):
            optimizer.step()
            return
        if any(grad is None for grad in grads):
            optimizer.step()  # torch's step skips parameters without a gradient
            return
        assert self.state_lists is not None  # gathered above
        exp_avgs, exp_avg_sqs, steps = self.state_lists
        beta1, beta2 = group["betas"]
        with torch.no_grad():
            torch._foreach_add_(steps, 1)
            torch._fused_adam_(
                params,
                grads,
                exp_avgs,
                exp_avg_sqs,
                [],
                steps,
                amsgrad=False,
                lr=group["lr"],
                beta1=beta1,
                beta2=beta2,
                weight_decay=group["weight_decay"],
                eps=group["eps"],
                maximize=group["maximize"],
                grad_scale=None,
                found_inf=None,
            )

    def _gather_state(self, group: dict, grads: list) -> bool:
        """Create (as optimizer.step() would) and look up the state of every parameter; False where this path does
        not apply and optimizer.step() must run."""
        optimizer = self.optimizer
        params = group["params"]
        supported = (
            isinstance(optimizer, torch.optim.Adam)
            and len(optimizer.param_groups) == 1
            and group.get("fused")
            and not group.get("amsgrad")
            and not group.get("differentiable")
            and not group.get("capturable")
            and not group.get("decoupled_weight_decay", False)
            and isinstance(group["lr"], float)
            and getattr(optimizer, "grad_scale", None) is None  # a GradScaler's unscaling goes through step()
            and getattr(optimizer, "found_inf", None) is None
            and not optimizer._optimizer_step_pre_hooks  # hooks, the optimizer's or every optimizer's, run in step()
            and not optimizer._optimizer_step_post_hooks
            and not getattr(optimizer_module, "_global_optimizer_pre_hooks", None)
            and not getattr(optimizer_module, "_global_optimizer_post_hooks", None)
            and all(grad is not None for grad in grads)
            and all(type(p) in (nn.Parameter, torch.Tensor) and p.dtype == torch.float32 for p in params)
            and len({p.device for p in params}) == 1
        )
        if not supported:
            return False
        with_grad: list[torch.Tensor] = []
        gathered_grads: list[torch.Tensor] = []
        exp_avgs: list[torch.Tensor] = []
        exp_avg_sqs: list[torch.Tensor] = []
        max_exp_avg_sqs: list[torch.Tensor] = []
        steps: list[torch.Tensor] = []
        optimizer._init_group(group, with_grad, gathered_grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps)
        if len(with_grad) != len(params):
            return False
        self.state_lists, self.gathered_from = (exp_avgs, exp_avg_sqs, steps), optimizer.state
        return True


@torch.no_grad()
def clip_grad_norm(params: Sequence[torch.Tensor], max_norm: float) -> None:
    """torch.nn.utils.clip_grad_norm_(params, max_norm): its kernels in its order, so the same gradients bit for
    bit, without its grouping of the gradients by device and dtype, which costs more than the kernels on a small
    network stepped per batch. Gradients of several devices or dtypes, or DTensors (fsdp), go through torch's."""
    grads = [param.grad for param in params if param.grad is not None]
    first = grads[0] if grads else None
    if first is None or any(
        type(grad) is not torch.Tensor or grad.device != first.device or grad.dtype != first.dtype for grad in grads
    ):
        nn.utils.clip_grad_norm_(params, max_norm)
        return
    norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
    # max_norm / (norm + 1e-6), clamped at 1, in place and in the ops `float / Tensor` dispatches to (reciprocal,
    # then mul: the same numbers) without Tensor.__rtruediv__'s Python wrapper.
    torch._foreach_mul_(grads, norm.add_(1e-6).reciprocal_().mul_(max_norm).clamp_(max=1.0))
