"""Running observation normalization, merged across the trainer group.

The statistics are model state: float64 buffers that travel with weight broadcasts and checkpoints, so every rank
that acts normalizes with exactly the trainer's numbers.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
from torch import Tensor, nn

from spmd_rl.runtime.distributed import bounded

CLIP = 10.0
EPS = 1e-8
DEFAULT_TIMEOUT = datetime.timedelta(seconds=300)


def merge_moments(
    count_a: Tensor, mean_a: Tensor, m2_a: Tensor, count_b: Tensor, mean_b: Tensor, m2_b: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Chan et al.'s parallel merge of (count, mean, sum of squared deviations) for two disjoint sets of samples.

    Exact up to rounding and free of the cancellation that E[x^2] - E[x]^2 suffers when |mean| >> std.
    """
    count = count_a + count_b
    if count == 0:
        return count, mean_a, m2_a
    delta = mean_b - mean_a
    mean = mean_a + delta * (count_b / count)
    m2 = m2_a + m2_b + delta.square() * (count_a * count_b / count)
    return count, mean, m2


class RunningNormalizer(nn.Module):
    """(x - mean) / sqrt(var + eps), clipped to +-10, with running statistics updated from batches.

    When disabled, forward is the identity and update does nothing; the buffers stay so that checkpoints and weight
    buckets have the same layout whether or not normalization is on.
    """

    # Registered buffers (typed here: nn.Module's attribute lookup is typed Tensor | Module)
    mean: Tensor
    var: Tensor
    count: Tensor

    def __init__(self, shape: tuple[int, ...], enabled: bool = True):
        super().__init__()
        self.shape = tuple(shape)
        self.enabled = enabled
        self.register_buffer("mean", torch.zeros(self.shape, dtype=torch.float64))
        self.register_buffer("var", torch.ones(self.shape, dtype=torch.float64))
        self.register_buffer("count", torch.zeros((), dtype=torch.float64))

    def forward(self, x: Tensor) -> Tensor:
        if not self.enabled:
            return x
        # Normalizing in x's dtype keeps the per-step path cheap; the statistics themselves stay float64.
        mean = self.mean.to(x.dtype)
        std = (self.var + EPS).sqrt().to(x.dtype)
        return ((x - mean) / std).clamp(-CLIP, CLIP)

    @torch.no_grad()
    def update(
        self, x: Tensor, group: dist.ProcessGroup | None = None, timeout: datetime.timedelta = DEFAULT_TIMEOUT
    ) -> None:
        """Fold a batch x[B, *shape] into the running statistics.

        With a group (and torch.distributed initialized), every member's batch statistics are gathered and merged,
        so all members end with the statistics of the concatenation of their batches. Every member must call this.
        """
        if not self.enabled:
            return
        x = x.reshape(-1, *self.shape).to(self.mean.device, torch.float64)
        count = torch.tensor(float(x.shape[0]), dtype=torch.float64, device=x.device)
        mean = x.mean(0) if x.shape[0] > 0 else torch.zeros_like(self.mean)
        m2 = (x - mean).square().sum(0)
        if group is not None and dist.is_available() and dist.is_initialized():
            count, mean, m2 = self._merge_across(group, count, mean, m2, timeout)
        running_m2 = self.var * self.count
        new_count, new_mean, new_m2 = merge_moments(self.count, self.mean, running_m2, count, mean, m2)
        if new_count == 0:
            return
        self.count.copy_(new_count)
        self.mean.copy_(new_mean)
        self.var.copy_(new_m2 / new_count)

    def _merge_across(
        self, group: dist.ProcessGroup, count: Tensor, mean: Tensor, m2: Tensor, timeout: datetime.timedelta
    ) -> tuple[Tensor, Tensor, Tensor]:
        if dist.get_rank(group) < 0:
            raise RuntimeError(
                f"rank {dist.get_rank()} is not a member of the normalizer's group; "
                "a collective called by a non-member silently does nothing"
            )
        # One message per rank: [count, mean..., m2...] in float64; the merge below is Chan's, over all ranks at once.
        local = torch.cat([count.reshape(1), mean.reshape(-1), m2.reshape(-1)])
        gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        bounded(
            dist.all_gather,
            gathered,
            local,
            group=group,
            timeout=timeout,
            what="observation normalizer all_gather of batch statistics",
        )
        table = torch.stack(gathered)
        size = mean.numel()
        counts, means, m2s = table[:, 0], table[:, 1 : 1 + size], table[:, 1 + size :]
        total = counts.sum()
        if total == 0:
            return total, mean, m2
        merged_mean = (counts[:, None] * means).sum(0) / total
        merged_m2 = m2s.sum(0) + (counts[:, None] * (means - merged_mean).square()).sum(0)
        return total, merged_mean.reshape(self.shape), merged_m2.reshape(self.shape)

    def extra_repr(self) -> str:
        return f"shape={self.shape}, enabled={self.enabled}"
