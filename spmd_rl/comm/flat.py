"""Flat byte buffers that hold many tensors as views (channel messages, weight buckets): where each view starts."""

ALIGNMENT = 64  # every view's byte offset: any dtype's alignment, and whole cache lines


def aligned(offset: int) -> int:
    """The first aligned offset at or after `offset`."""
    return -(-offset // ALIGNMENT) * ALIGNMENT
