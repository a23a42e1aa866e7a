"""The Algorithm contract (learns on trainer ranks), its schedule, the facts of the plan it may check, the
Callback contract, and the Context the framework hands both."""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import gymnasium as gym
import torch
import torch.distributed as dist
from torch import Tensor, nn

from spmd_rl.config.schema import AlgorithmConfig, NoConfig
from spmd_rl.interfaces.policy import Policy
from spmd_rl.runtime.distributed import bounded

if TYPE_CHECKING:  # annotations only: importing tensordict costs seconds (torch._dynamo)
    from tensordict import TensorDict


@dataclass(frozen=True)
class Schedule:
    """When weights move and how the policy acts, per algorithm; the engine plans every rank's sends with it."""
    weight_sync_every: int = 1      # iterations between weight broadcasts to the inference ranks
    random_steps: int = 0           # env steps (all env ranks) acting uniformly at random before the policy acts
    max_policy_lag: int = 0         # policy versions a step may lag behind the learner (0: on-policy)


@dataclass(frozen=True)
class PlanFacts:
    """What an algorithm may check its config against before any process group exists."""
    trainer_ranks: int
    env_ranks: int
    steps_per_iteration: int        # all env ranks together
    samples_per_trainer: int        # env steps a trainer learns from per iteration
    num_iterations: int


class Algorithm:
    """Learns from the segments its trainer receives. Subclass it; set `Config` (a dataclass subclassing
    AlgorithmConfig, which gives `num_steps`), `default_policy` on the Config, and `requires`."""

    Config: ClassVar[type] = AlgorithmConfig
    requires: ClassVar[tuple[str, ...]] = ()            # step fields beyond obs/action/ENV_FIELDS (e.g. log_prob)
    policy_methods: ClassVar[tuple[str, ...]] = ()      # methods the policy must have (e.g. PPO: evaluate, value)

    @classmethod
    def schedule(cls, config: AlgorithmConfig) -> Schedule:
        return Schedule()

    @classmethod
    def check_plan(cls, config: AlgorithmConfig, plan: PlanFacts) -> None:
        """Raise spmd_rl.runtime.errors.UserError for a config that cannot work with this layout (runs before any
        process group, on every rank)."""

    @classmethod
    def summary(cls, config: AlgorithmConfig, plan: PlanFacts) -> str:
        """What rank 0 adds to the plan it prints at start (batch sizes and the like); '' for nothing."""
        return ""

    def __init__(self, policy: Policy, config: AlgorithmConfig, context: Context):
        self.policy = policy
        self.config = config
        self.context = context

    def learn(self, segment: TensorDict, iteration: int) -> dict[str, float]:
        """One iteration's learning; returns scalars for metrics.jsonl (the first trainer's are logged)."""
        raise NotImplementedError

    def state_dict(self) -> dict:
        """Everything beyond the policy's weights needed to continue exactly (optimizers, critics, ...)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def close(self) -> None:
        """Release files (replay shards); called once at the end, and on the way out after an error."""


class Callback:
    """Called on every trainer rank after every iteration. `metrics` is that iteration's record: on the first
    trainer (global rank 0) the whole metrics.jsonl line (episode returns, timings, evaluation results when
    `eval.every` asks); elsewhere iteration, env_steps and the algorithm's own scalars. Return scalars to add to
    metrics.jsonl and TensorBoard (the first trainer's are logged), or None."""

    Config: ClassVar[type] = NoConfig

    def __init__(self, config: Any, context: Context):
        self.config = config
        self.context = context

    def on_iteration_end(self, iteration: int, metrics: dict, algorithm: Algorithm) -> dict[str, float] | None:
        return None


@dataclass
class Context:
    """The trainer's surroundings, handed to its Algorithm (and Callbacks)."""
    rank: int                               # global rank of this trainer
    trainer_index: int                      # 0 .. num_trainers-1
    num_trainers: int
    group: dist.ProcessGroup | None         # the trainer group; None with a single trainer
    device: torch.device
    timeout: datetime.timedelta
    run_dir: Path
    seed: int
    num_iterations: int
    steps_per_iteration: int                # env steps per iteration, all env ranks together
    observation_space: gym.Space
    action_space: gym.Space
    buffer: Any = None                      # the buffer config section (replay capacity, backend, files)

    @classmethod
    def local(cls, observation_space: gym.Space, action_space: gym.Space, *, group: dist.ProcessGroup | None = None,
              num_iterations: int = 1, steps_per_iteration: int = 1, run_dir: str | Path = ".", seed: int = 1,
              device: str = "cpu", timeout_s: float = 300.0, buffer: Any = None) -> Context:
        """A context outside a launched run: for unit tests of an algorithm and for notebooks. With a group, this
        process is one of its trainers."""
        from spmd_rl.config.schema import BufferSection
        in_group = group is not None
        return cls(rank=dist.get_rank() if in_group else 0,
                   trainer_index=dist.get_rank(group) if in_group else 0,
                   num_trainers=dist.get_world_size(group) if in_group else 1, group=group,
                   device=torch.device(device), timeout=datetime.timedelta(seconds=timeout_s), run_dir=Path(run_dir),
                   seed=seed, num_iterations=num_iterations, steps_per_iteration=steps_per_iteration,
                   observation_space=observation_space, action_space=action_space,
                   buffer=buffer if buffer is not None else BufferSection())

    # -- data parallelism ---------------------------------------------------------------------------------------

    def data_parallel(self, module: nn.Module) -> nn.Module:
        """The module to run forward/backward through: DDP over the trainer group, or the module itself alone.
        Only forward() is hooked, so route your loss through `wrapped(...)`."""
        if self.group is None:
            return module
        from torch.nn.parallel import DistributedDataParallel
        # Buffers (normalizer statistics) are merged by their own all-reduce, not synced on every forward.
        return DistributedDataParallel(module, process_group=self.group, forward_sync_buffers=False)

    def average_gradients(self, grads: list[Tensor] | tuple[Tensor, ...], what: str = "gradients"
                          ) -> tuple[Tensor, ...]:
        """The mean over trainers of these gradients, in one flat all-reduce (identity for one trainer)."""
        if self.group is None:
            return tuple(grads)
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
        flat = _flatten_dense_tensors(list(grads))
        self.all_reduce(flat, what, mean=True)
        return _unflatten_dense_tensors(flat, list(grads))

    # -- bounded collectives over the trainer group --------------------------------------------------------------

    def all_reduce(self, tensor: Tensor, what: str, mean: bool = False) -> Tensor:
        """Sum (or mean) over trainers, in place; bounded by dist.timeout_s; `what` names it in errors."""
        if self.group is None:
            return tensor
        bounded(dist.all_reduce, tensor, group=self.group, timeout=self.timeout, what=f"{what} all_reduce")
        if mean:
            tensor /= self.num_trainers  # gloo has no AVG reduction
        return tensor

    def broadcast(self, tensor: Tensor, what: str, src_index: int = 0) -> Tensor:
        """Trainer src_index's tensor to every trainer, in place."""
        if self.group is None:
            return tensor
        src = dist.get_process_group_ranks(self.group)[src_index]
        bounded(dist.broadcast, tensor, src=src, group=self.group, timeout=self.timeout,
                what=f"{what} broadcast from rank {src}")
        return tensor

    def merge_normalizer(self, normalizer: nn.Module, obs: Tensor) -> None:
        """Fold obs into a RunningNormalizer with every trainer's batch (all trainers end with equal statistics)."""
        normalizer.update(obs, group=self.group, timeout=self.timeout)

    # -- replay ---------------------------------------------------------------------------------------------------

    def replay_buffer(self, example: TensorDict, name: str = "replay"):
        """This trainer's shard of a replay buffer sampled uniformly over all trainers' shards: `add(rows)`,
        `sample(batch_size)` (batch_size over all trainers; each gets its share), `close()`. Rows are laid out
        like `example` (a TensorDict with one batch dimension). Memory or HDF5 by buffer.backend."""
        from spmd_rl.runtime.limits import check_memory
        from spmd_rl.storage.replay import LocalReplay, ReplayBuffer, ShardedReplay
        cfg = self.buffer
        if cfg.backend == "memory":  # checked before allocating: an absurd capacity is a user error, not an OOM
            row_bytes = sum(t.element_size() * t[0].numel() for t in example.values(True, True))
            check_memory(cfg.capacity * row_bytes, f"the replay shard of rank {self.rank} ({cfg.capacity} rows of "
                         f"{row_bytes} bytes)", "buffer.capacity (or use buffer.backend=hdf5)")
        shard = ReplayBuffer(cfg.capacity, example, backend=cfg.backend,
                             path=self.run_dir / "buffer" / f"{name}_rank{self.rank}.h5", chunk_rows=cfg.chunk_rows,
                             compression=cfg.h5_compression, flush_every_s=cfg.flush_every_s)
        if self.group is None:
            return LocalReplay(shard)
        return ShardedReplay(shard, self.group, self.timeout, seed=self.seed)
