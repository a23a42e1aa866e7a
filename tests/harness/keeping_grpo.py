"""GRPO that keeps every segment it learned from, as an algorithm that learns over several rollouts would:

    algo.class=tests.harness.keeping_grpo:KeepingGRPO

At each learn it checks that every segment it kept still holds what it held when learn received it (a snapshot
taken then), and fails the run naming the iteration whose segment changed after its learn returned. Its metrics add
segments_kept.
"""

from __future__ import annotations

from spmd_rl.algorithms.grpo import GRPO


class KeepingGRPO(GRPO):
    def __init__(self, policy, config, context):
        super().__init__(policy, config, context)
        self.kept = []  # (iteration, the segment learn received, a snapshot of it)

    def learn(self, segment, iteration: int) -> dict[str, float]:
        for earlier, kept, snapshot in self.kept:
            if not bool((kept == snapshot).all()):
                raise AssertionError(f"the segment of iteration {earlier} changed after its learn returned")
        self.kept.append((iteration, segment, segment.clone()))
        return {**super().learn(segment, iteration), "segments_kept": float(len(self.kept))}
