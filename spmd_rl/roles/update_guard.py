"""A learning update that produced NaN or inf: an error naming the iteration, or (train.skip_nonfinite_updates)
an update undone and counted.

Wrapped around every Algorithm.learn, built-in or the user's, so no algorithm has to check for itself. After each
update it looks at the returned metrics whose name contains "loss" and at the policy's parameters; a non-finite
gradient shows up there, since the optimizer step spreads it into the weights. The parameter check is one fused
norm over all of them per iteration (a non-finite norm is then confirmed tensor by tensor, so only a true NaN or
inf counts, not a norm that overflows).

Skipping restores what an update changes: the policy's parameters and buffers, every module and tensor the
algorithm holds as an attribute (critics, targets, a temperature), and every optimizer's state (a NaN gradient
poisons Adam's moments, and restoring the weights alone would make every later update NaN as well). Replay
buffers and counters are left as they are. With several trainers the decision is agreed (one tiny all-reduce), so
all of them skip the same update and their weights stay equal.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from spmd_rl.runtime.errors import UserCodeError

SKIPPED_METRIC = "nonfinite_updates_skipped"


class UpdateGuard:
    def __init__(self, algorithm, skip: bool, describe: str, sharded: bool = False):
        self.algorithm = algorithm
        # The API's Algorithm.__init__ keeps both; an algorithm that skipped it is checked by its metrics alone.
        self.policy = getattr(algorithm, "policy", None) or nn.Module()
        self.context = getattr(algorithm, "context", None)
        self.skip = skip
        self.describe = describe
        self.skipped = 0
        # train.parallel=fsdp refuses train.skip_nonfinite_updates (run/plan.py): the line must not advise it
        # (fault pass 7, NL2: the advice led to that refusal)
        self.sharded = sharded

    def learn(self, segment, iteration: int) -> dict[str, float]:
        saved = self._snapshot() if self.skip else None
        metrics = self.algorithm.learn(segment, iteration)
        problem = self._problem(metrics)
        if not self.skip:
            if problem:
                skip = "" if self.sharded else ", or set train.skip_nonfinite_updates=true to skip such updates"
                raise UserCodeError(
                    f"{self.describe}: the update of iteration {iteration} produced {problem}; "
                    f"fix the algorithm or its settings (learning rate, gradient clipping){skip}"
                )
            return metrics
        if self._agree(bool(problem)):
            self._restore(saved)
            self.skipped += 1
        return {**metrics, SKIPPED_METRIC: float(self.skipped)}

    # -- what is wrong --------------------------------------------------------------------------------------------

    def _problem(self, metrics: dict) -> str:
        """'' when the update looks finite; otherwise what is not, in words."""
        losses = [
            f"{key}={value}"
            for key, value in (metrics or {}).items()
            if "loss" in key and isinstance(value, (int, float)) and not math.isfinite(value)
        ]
        if losses:
            return f"a non-finite loss ({', '.join(losses)})"
        parameters = [p for p in self.policy.parameters()]
        if not parameters or bool(torch.isfinite(torch.nn.utils.get_total_norm(parameters, foreach=True))):
            return ""
        bad = [name for name, p in self.policy.named_parameters() if not bool(torch.isfinite(p).all())]
        if not bad:
            return ""  # the norm overflowed; every value is finite
        shown = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
        return f"non-finite policy parameters ({shown}): a gradient or loss was NaN or inf"

    def _agree(self, mine: bool) -> bool:
        """Whether any trainer found a problem (every trainer gets the same answer)."""
        if self.context is None or self.context.group is None:
            return mine
        flag = torch.tensor([1.0 if mine else 0.0])
        self.context.all_reduce(flag, "non-finite update check")
        return bool(flag.item() > 0)

    # -- undoing an update ----------------------------------------------------------------------------------------

    def _learnable_state(self) -> tuple[list[torch.Tensor], list[torch.optim.Optimizer]]:
        """The tensors an update may change (each once) and the optimizers, found on the policy and as attributes
        of the algorithm (directly or in a list, tuple or dict attribute)."""
        tensors: dict[int, torch.Tensor] = {}
        optimizers: dict[int, torch.optim.Optimizer] = {}

        def add(value) -> None:
            if isinstance(value, nn.Module):
                for tensor in (*value.parameters(), *value.buffers()):
                    tensors.setdefault(id(tensor), tensor)
            elif isinstance(value, torch.Tensor):
                tensors.setdefault(id(value), value)
            elif isinstance(value, torch.optim.Optimizer):
                optimizers.setdefault(id(value), value)

        add(self.policy)
        for value in vars(self.algorithm).values():
            for item in (
                value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else (value,)
            ):
                add(item)
        return list(tensors.values()), list(optimizers.values())

    def _snapshot(self):
        tensors, optimizers = self._learnable_state()
        return (
            [(t, t.detach().clone()) for t in tensors],
            [(opt, _clone_tree(opt.state_dict())) for opt in optimizers],
        )

    def _restore(self, saved) -> None:
        tensors, optimizers = saved
        with torch.no_grad():
            for tensor, copy in tensors:
                tensor.copy_(copy)  # in place: views into weight-sync buckets and DDP's references stay valid
        for optimizer, state in optimizers:
            optimizer.load_state_dict(state)


def _clone_tree(value):
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {key: _clone_tree(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_clone_tree(item) for item in value)
    return value
