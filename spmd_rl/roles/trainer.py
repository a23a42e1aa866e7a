"""The trainer's story: receive the rollout segments of my env ranks, compute advantages, update the policy with
my fellow trainers (DDP over the trainer group), and publish the new weights to the inference ranks.
"""

from __future__ import annotations

import datetime
import time

import torch
import torch.distributed as dist
from tensordict import TensorDict

from spmd_rl.errors import CommError
from spmd_rl.roles.update_guard import UpdateGuard
from spmd_rl.runtime import bounded, comm_error, group_peer, is_comm_failure


class StalePolicyError(RuntimeError):
    """In sync mode every env step must use the weights of the current iteration."""


class Trainer:
    def __init__(self, algorithm, segment_channels: list, segment_sources: list[str], episode_slots: int, group,
                 weight_sync=None, experience_log=None, describe: str = "trainer",
                 timeout: datetime.timedelta = datetime.timedelta(seconds=300), skip_nonfinite_updates: bool = False):
        self.algorithm = algorithm          # the user's (or a built-in) spmd_rl.api.Algorithm
        self.segment_channels = segment_channels
        self.segment_sources = segment_sources  # who sends each segment, for error messages
        # Every trainer gathers the same fixed number of episode slots (the most env columns any trainer has).
        self.episode_slots = episode_slots
        self.group = group                  # trainer group (None: a single trainer)
        self.weight_sync = weight_sync      # trainer rank 0 of a split layout only
        self.experience_log = experience_log
        self.describe = describe
        self.timeout = timeout              # bound on the trainer group's collectives (dist.timeout_s)
        self.update_guard = UpdateGuard(algorithm, skip_nonfinite_updates, describe)
        self.learn_s = self.weight_sync_s = 0.0

    # -- one iteration -------------------------------------------------------------------------------------------

    def receive_segments(self, expected_version: int) -> TensorDict:
        pending = [ch.irecv() for ch in self.segment_channels]
        segments = [message.wait() for message in pending]
        for source, segment in zip(self.segment_sources, segments):
            versions = segment["policy_version"]
            if bool((versions != expected_version).any()):
                raise StalePolicyError(
                    f"{self.describe}: segment from {source} used policy versions "
                    f"{sorted(set(versions.tolist()))}, expected only {expected_version} (sync mode)")
        if len(segments) == 1:
            return segments[0]
        return TensorDict({
            "rollout": torch.cat([s["rollout"] for s in segments], dim=1),
            "next_obs": torch.cat([s["next_obs"] for s in segments]),
            "policy_version": segments[0]["policy_version"],
            "env_s": torch.cat([s["env_s"] for s in segments]),
            "action_wait_s": torch.cat([s["action_wait_s"] for s in segments]),
            "inference_s": torch.cat([s["inference_s"] for s in segments]),
        }, batch_size=[])

    def learn(self, segment: TensorDict, iteration: int) -> dict[str, float]:
        clock = time.perf_counter()
        if self.experience_log is not None:
            rollout = segment["rollout"]
            self.experience_log.append(rollout, policy_version=int(segment["policy_version"][0]),
                                       env_step=iteration * rollout.numel())
        try:
            metrics = self.update_guard.learn(segment, iteration)
        except Exception as exc:
            # DDP's gradient all-reduce fails inside backward() as a plain RuntimeError; bounded collectives raise
            # CommError themselves. Anything else is the algorithm's own error.
            if isinstance(exc, CommError) or not is_comm_failure(exc):
                raise
            raise comm_error(f"{self.describe}: learning (iteration {iteration}): a collective in the trainer group "
                             f"(DDP's gradient all-reduce or the algorithm's own)", exc,
                             self.timeout, group_peer(self.group) if self.group is not None else None) from exc
        self.learn_s = time.perf_counter() - clock
        return metrics

    def close(self) -> None:
        self.algorithm.close()
        if self.experience_log is not None:
            self.experience_log.close()

    def publish_weights(self, version: int, verify: bool) -> None:
        if self.weight_sync is None:
            return
        clock = time.perf_counter()
        self.weight_sync.broadcast(version)
        if verify:
            self.weight_sync.verify(version)
        self.weight_sync_s = time.perf_counter() - clock

    def gather_statistics(self, segment: TensorDict) -> dict | None:
        """Episode results and env-side timings of ALL env ranks, gathered onto the group's first rank."""
        rollout = segment["rollout"]
        done = rollout["episode_done"]
        local = {
            "returns": rollout["episode_return"][done].double(),
            "lengths": rollout["episode_length"][done].double(),
            "env_s": segment["env_s"].sum().item(),
            "action_wait_s": segment["action_wait_s"].sum().item(),
            "inference_s": segment["inference_s"].sum().item(),
            "env_ranks": float(segment["env_s"].numel()),
        }
        if self.group is None or dist.get_world_size(self.group) == 1:
            return local
        # Fixed-size tensors (padded with NaN) so the gather needs no negotiation of sizes.
        slots = self.episode_slots
        packed = torch.full((2 * slots + 4,), float("nan"), dtype=torch.float64)
        count = local["returns"].numel()
        packed[:count] = local["returns"]
        packed[slots:slots + count] = local["lengths"]
        packed[2 * slots:] = torch.tensor([local["env_s"], local["action_wait_s"], local["inference_s"],
                                           local["env_ranks"]], dtype=torch.float64)
        gathered = [torch.empty_like(packed) for _ in range(dist.get_world_size(self.group))]
        bounded(dist.all_gather, gathered, packed, group=self.group, timeout=self.timeout,
                what="all_gather of episode statistics in the trainer group")
        if dist.get_rank(self.group) != 0:
            return None
        merged = torch.stack(gathered)
        returns, lengths = merged[:, :slots], merged[:, slots:2 * slots]
        sums = merged[:, 2 * slots:].sum(0)
        return {
            "returns": returns[~returns.isnan()], "lengths": lengths[~lengths.isnan()],
            "env_s": sums[0].item(), "action_wait_s": sums[1].item(), "inference_s": sums[2].item(),
            "env_ranks": sums[3].item(),
        }


def run_trainer_rank(trainer: Trainer, schedule, verify_every: int, report, iterations: range,
                     after_iteration) -> None:
    """A split-layout trainer rank. report(iteration, metrics, statistics, trainer) runs on every trainer; the
    metrics logger inside it writes on the first trainer only. after_iteration(iteration) is the run's
    end-of-iteration agreement (checkpoints, stops)."""
    # Inference ranks start from trainer rank 0's weights (initial or resumed), never from matching seeds.
    trainer.publish_weights(schedule.version_at(iterations.start), verify=False)
    for iteration in iterations:
        trainer.weight_sync_s = 0.0
        segment = trainer.receive_segments(expected_version=schedule.version_at(iteration))
        metrics = trainer.learn(segment, iteration)
        if schedule.syncs_after(iteration):
            version = schedule.version_at(iteration + 1)
            trainer.publish_weights(version, verify=bool(verify_every) and version % verify_every == 0)
        report(iteration, metrics, trainer.gather_statistics(segment), trainer)
        after_iteration(iteration)
