"""RunningNormalizer: running statistics equal those of all data seen, on one rank and merged across gloo ranks."""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
from harness.multiproc import assert_all_ok, run_ranks

from spmd_rl.modules.normalizer import RunningNormalizer

SHAPE = (3,)


def rank_batches(rank: int) -> list[torch.Tensor]:
    """Two batches of different sizes per rank, far from zero mean, so a naive E[x^2] - E[x]^2 would lose digits."""
    generator = torch.Generator().manual_seed(100 + rank)
    sizes = [5 + 3 * rank, 11 - rank]
    offset = torch.tensor([1e4, -50.0, 0.0], dtype=torch.float64) * (rank + 1)
    return [torch.randn(n, *SHAPE, generator=generator, dtype=torch.float64) * (rank + 1) + offset for n in sizes]


def assert_stats_of(normalizer: RunningNormalizer, data: torch.Tensor) -> None:
    expected = data.numpy()
    assert normalizer.count.item() == expected.shape[0]
    np.testing.assert_allclose(normalizer.mean.numpy(), expected.mean(0), rtol=1e-12, atol=1e-9)
    np.testing.assert_allclose(normalizer.var.numpy(), expected.var(0), rtol=1e-9)


def test_running_stats_equal_stats_of_concatenated_batches():
    normalizer = RunningNormalizer(SHAPE)
    batches = rank_batches(0) + rank_batches(1)
    for batch in batches:
        normalizer.update(batch)
    assert_stats_of(normalizer, torch.cat(batches))


def test_forward_normalizes_clips_and_keeps_dtype():
    normalizer = RunningNormalizer((2,))
    normalizer.update(torch.tensor([[0.0, 10.0], [2.0, 10.0]]))  # mean [1, 10], var [1, 0]
    out = normalizer(torch.tensor([[3.0, 10.0], [1.0, 11.0]], dtype=torch.float32))
    assert out.dtype == torch.float32
    # var 0 in the second feature: (x - mean) / sqrt(eps) is huge, and clipped to +10.
    torch.testing.assert_close(out, torch.tensor([[2.0, 0.0], [0.0, 10.0]]), rtol=0, atol=1e-6)


def test_disabled_is_identity_but_keeps_its_buffers():
    normalizer = RunningNormalizer(SHAPE, enabled=False)
    x = torch.randn(4, *SHAPE) * 100
    normalizer.update(x)
    assert normalizer(x) is x
    assert normalizer.count.item() == 0
    state = normalizer.state_dict()
    assert set(state) == {"mean", "var", "count"}
    assert all(t.dtype == torch.float64 for t in state.values())
    assert state.keys() == RunningNormalizer(SHAPE, enabled=True).state_dict().keys()


def _merge_on_ranks(rank: int, world_size: int) -> None:
    normalizer = RunningNormalizer(SHAPE)
    for batch in rank_batches(rank):
        normalizer.update(batch, group=dist.group.WORLD)
    every_rank = [rank_batches(r) for r in range(world_size)]
    # Each collective merged one batch of every rank: the concatenation of all batches is what was seen.
    assert_stats_of(normalizer, torch.cat([batch for batches in every_rank for batch in batches]))


def test_statistics_merged_across_three_ranks_equal_concatenated_data():
    assert_all_ok(run_ranks(_merge_on_ranks, 3, timeout_s=30))
