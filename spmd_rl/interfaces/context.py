"""The Context the framework hands an Algorithm and its Callbacks: where the trainer stands (its group, device,
timeout, run directory) and helpers so user code has no distributed plumbing (data parallelism, gradient
averaging, bounded collectives, a sharded replay buffer, normalizer merging)."""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

import gymnasium as gym
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from spmd_rl.comm import sharding
from spmd_rl.comm.parallel_plan import shards
from spmd_rl.comm.sharding import ModuleT
from spmd_rl.config.sections import BufferSection
from spmd_rl.runtime.distributed import bounded
from spmd_rl.runtime.fast_imports import data_parallel_without_dynamo
from spmd_rl.runtime.limits import check_memory

if TYPE_CHECKING:  # annotations only: importing tensordict costs seconds (torch._dynamo)
    from tensordict import TensorDict

    from spmd_rl.storage.replay import Replay


class MergedNormalizer(Protocol):
    """What merge_normalizer needs of a normalizer (spmd_rl.modules.normalizer.RunningNormalizer's update)."""

    def update(self, x: Tensor, group: dist.ProcessGroup | None, timeout: datetime.timedelta) -> None: ...


@dataclass
class Context:
    """The trainer's surroundings, handed to its Algorithm (and Callbacks)."""

    rank: int  # global rank of this trainer
    trainer_index: int  # 0 .. num_trainers-1
    num_trainers: int
    group: dist.ProcessGroup | None  # the trainer group; None with a single trainer
    device: torch.device
    timeout: datetime.timedelta
    run_dir: Path
    seed: int
    num_iterations: int
    steps_per_iteration: int  # env steps per iteration, all env ranks together
    observation_space: gym.Space[Any]
    action_space: gym.Space[Any]
    buffer: Any = None  # the buffer config section (replay capacity, backend, files)
    parallel: str = "ddp"  # train.parallel: ddp (replicas) or fsdp (sharded over the trainer group)
    precision: str = "fp32"  # train.precision: fp32 or bf16 (compute; master weights stay float32)
    activation_checkpointing: bool = False  # train.activation_checkpointing
    # The policy methods the algorithm calls (its class's policy_methods, plus act): with fsdp they all-gather the
    # parameters as forward does; with bf16 they compute in bfloat16 and return float32.
    policy_methods: tuple[str, ...] = ("act",)
    # train.shard_group_size: (replicate group, shard group, [[global ranks] per replica]) for hybrid sharding
    hybrid_shards: tuple[Any, ...] | None = None
    group_size: int = 1  # env.group_size: a segment's env columns come in blocks of this many that started together
    # Where every rank is also an env rank (one process, colocated), the engine's way to roll one more rollout within
    # an iteration: extra_rollout(iteration) steps every env of this rank through one more rollout with the current
    # weights and returns this trainer's segment of it. Every trainer must call it equally often (decide with an
    # all_reduce). None where the layout cannot (split: env ranks follow the plan alone).
    extra_rollout: Callable[[int], TensorDict] | None = None
    # Where a sharded trainer handed its algorithm the policy on the meta device (Algorithm.takes_policy_on_meta):
    # data_parallel calls it with the module once sharded, to give it its device and its shards' values.
    materialise: Callable[[nn.Module], None] | None = None

    @classmethod
    def local(
        cls,
        observation_space: gym.Space[Any],
        action_space: gym.Space[Any],
        *,
        group: dist.ProcessGroup | None = None,
        num_iterations: int = 1,
        steps_per_iteration: int = 1,
        run_dir: str | Path = ".",
        seed: int = 1,
        device: str = "cpu",
        timeout_s: float = 300.0,
        buffer: Any = None,
        parallel: str = "ddp",
        precision: str = "fp32",
        activation_checkpointing: bool = False,
        policy_methods: tuple[str, ...] = ("act",),
        group_size: int = 1,
    ) -> Context:
        """A context outside a launched run: for unit tests of an algorithm and for notebooks. With a group, this
        process is one of its trainers."""
        in_group = group is not None
        return cls(
            rank=dist.get_rank() if in_group else 0,
            trainer_index=dist.get_rank(group) if in_group else 0,
            num_trainers=dist.get_world_size(group) if in_group else 1,
            group=group,
            device=torch.device(device),
            timeout=datetime.timedelta(seconds=timeout_s),
            run_dir=Path(run_dir),
            seed=seed,
            num_iterations=num_iterations,
            steps_per_iteration=steps_per_iteration,
            observation_space=observation_space,
            action_space=action_space,
            buffer=buffer if buffer is not None else BufferSection(),
            parallel=parallel,
            precision=precision,
            activation_checkpointing=activation_checkpointing,
            policy_methods=policy_methods,
            group_size=group_size,
        )

    @property
    def sharded(self) -> bool:
        """Whether the policy is sharded over the trainers (train.parallel=fsdp) rather than replicated."""
        return shards(self.parallel)

    # -- data parallelism ---------------------------------------------------------------------------------------

    def data_parallel(self, module: nn.Module) -> nn.Module:
        """The module to run forward/backward through, laid out as train.parallel says.

        - ddp: DDP over the trainer group (the module itself with one trainer). Only forward() is hooked, so route
          your loss through `wrapped(...)`.
        - fsdp: the module itself, sharded in place with FSDP2 over the trainer group (spmd_rl.comm.sharding:
          shard units, registered methods). Call it, or the policy methods your algorithm declares, as usual;
          gradients are reduce-scattered in backward and the optimizer steps on the shards. A policy handed over on
          the meta device (Algorithm.takes_policy_on_meta) is given its shards' values here, after sharding.
        With train.precision=bf16 forward and those methods compute in bfloat16 and return float32; with
        train.activation_checkpointing each shard unit recomputes its activations in backward."""
        if self.activation_checkpointing:
            sharding.checkpoint_activations(sharding.shard_units(module))
        bf16 = self.precision == "bf16"
        if bf16:
            sharding.compute_in_bf16(module, self.policy_methods, self.device.type)
        if self.sharded:
            group = self.group if self.group is not None else sharding.single_process_group(self.device)
            sharded = sharding.shard_policy(module, group, self.device, self.policy_methods, bf16, self.hybrid_shards)
            if self.materialise is not None and any(p.is_meta for p in module.parameters()):
                self.materialise(sharded)
            return sharded
        if self.group is None:
            return module
        # Buffers (normalizer statistics) are merged by their own all-reduce, not synced on every forward.
        return data_parallel_without_dynamo(module, process_group=self.group, forward_sync_buffers=False)

    def shard(self, module: ModuleT, methods: tuple[str, ...] = ()) -> ModuleT:
        """For an algorithm that steps its optimizers itself over several modules (SAC's actor, critics and target
        critics): the module laid out as train.parallel says, without a DDP wrapper. Compute its gradients with
        `backward` and average them with `reduce_gradients`, which work in either layout.

        - ddp: the module itself (`reduce_gradients` averages the gradients over the trainers in one all-reduce).
        - fsdp: the module sharded in place with FSDP2 over the trainer group, with `methods` (besides forward)
          all-gathering its parameters as forward does; its gradients are reduce-scattered in backward.
        train.precision=bf16 and train.activation_checkpointing apply as with data_parallel (forward and `methods`
        in bfloat16, returning float32)."""
        if self.activation_checkpointing:
            sharding.checkpoint_activations(sharding.shard_units(module))
        bf16 = self.precision == "bf16"
        if bf16:
            sharding.compute_in_bf16(module, methods, self.device.type)
        if not self.sharded:
            return module
        group = self.group if self.group is not None else sharding.single_process_group(self.device)
        return sharding.shard_policy(module, group, self.device, methods, bf16, self.hybrid_shards)

    def backward(self, loss: Tensor, params: Sequence[Tensor], accumulate: bool = False) -> None:
        """The gradients of loss for params, into their .grad (added to it with accumulate, for a batch in parts);
        this trainer's own until `reduce_gradients`.

        ddp: torch.autograd.grad for exactly these parameters: none land anywhere else (SAC's actor loss goes
        through the critics, whose gradients that step must not touch). fsdp: loss.backward() through the sharded
        modules, which reduce-scatter their parameters' gradients over the trainers as it runs (FSDP reduces only
        in backward); gradients that land on other parameters are left there, so a step clears its own parameters'
        gradients first (accumulate False) and never reads another step's."""
        if self.sharded:
            if not accumulate:
                for param in params:
                    param.grad = None
            loss.backward()
            return
        grads = torch.autograd.grad(loss, params)
        for param, grad in zip(params, grads):
            param.grad = grad if not accumulate or param.grad is None else param.grad + grad

    def reduce_gradients(self, params: Sequence[Tensor], what: str = "gradients") -> None:
        """params' .grad (from `backward`) replaced by their mean over the trainers: in one flat all-reduce (ddp), or
        with fsdp only those of parameters outside the sharded modules (a temperature), the sharded ones having
        been reduced in backward already."""
        if self.sharded:
            params = [param for param in params if not sharding.is_dtensor(param)]
        if self.group is None or not params:
            return
        # cast: `backward` left a gradient on each of them
        for param, grad in zip(params, self.average_gradients([cast(Tensor, param.grad) for param in params], what)):
            param.grad = grad

    def average_gradients(self, grads: Sequence[Tensor], what: str = "gradients") -> tuple[Tensor, ...]:
        """The mean over trainers of these gradients, in one flat all-reduce (identity for one trainer)."""
        if self.group is None:
            return tuple(grads)
        flat = _flatten_dense_tensors(list(grads))
        self.all_reduce(flat, what, mean=True)
        return tuple(_unflatten_dense_tensors(flat, list(grads)))  # a tuple already: typed Any by torch

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
        bounded(
            dist.broadcast,
            tensor,
            src=src,
            group=self.group,
            timeout=self.timeout,
            what=f"{what} broadcast from rank {src}",
        )
        return tensor

    @torch.no_grad()
    def broadcast_tensors(self, tensors: list[Tensor], what: str, src_index: int = 0) -> None:
        """Trainer src_index's values of these tensors (parameters, buffers, any dtypes) into every trainer's, in
        place: one flat broadcast per dtype (a normalizer's float64 statistics beside float32 weights). An
        algorithm that builds modules of its own calls it once at start-up so that every trainer starts from the
        same ones; a no-op for a single trainer."""
        if self.group is None:
            return
        for dtype in sorted({t.dtype for t in tensors}, key=str):
            same_dtype = [t for t in tensors if t.dtype == dtype]
            flat = _flatten_dense_tensors([t.detach() for t in same_dtype])
            self.broadcast(flat, f"{what} ({dtype})", src_index)
            for tensor, value in zip(same_dtype, _unflatten_dense_tensors(flat, same_dtype)):
                tensor.copy_(value)

    def merge_normalizer(self, normalizer: MergedNormalizer, obs: Tensor) -> None:
        """Fold obs into a RunningNormalizer with every trainer's batch (all trainers end with equal statistics)."""
        normalizer.update(obs, group=self.group, timeout=self.timeout)

    # -- replay ---------------------------------------------------------------------------------------------------

    def replay_buffer(self, example: TensorDict, name: str = "replay") -> Replay:
        """This trainer's shard of a replay buffer sampled uniformly over all trainers' shards (a
        spmd_rl.storage.replay.Replay): `add(rows)`, `len()` (this shard's rows), `sample(batch_size)` (batch_size
        over all trainers; each gets its share), `close()`, and one `state_dict`/`load_state_dict` for a checkpoint
        (rows or file cursor, and the sampler). Rows are laid out like `example` (a TensorDict with one batch
        dimension). Memory or HDF5 by buffer.backend."""
        # Imported here: replay imports tensordict (seconds), which a policy or algorithm module importing the
        # API must not pay for to answer --help.
        from spmd_rl.storage.replay import LocalReplay, ReplayBuffer, ShardedReplay

        cfg = self.buffer
        if cfg.backend == "memory":  # checked before allocating: an absurd capacity is a user error, not an OOM
            leaves = [cast(Tensor, t) for t in example.values(True, True)]  # leaves_only: tensors
            row_bytes = sum(t.element_size() * t[0].numel() for t in leaves)
            check_memory(
                cfg.capacity * row_bytes,
                f"the replay shard of rank {self.rank} ({cfg.capacity} rows of {row_bytes} bytes)",
                "buffer.capacity (or use buffer.backend=hdf5)",
            )
        shard = ReplayBuffer(
            cfg.capacity,
            example,
            backend=cfg.backend,
            path=self.run_dir / "buffer" / f"{name}_rank{self.rank}.h5",
            chunk_rows=cfg.chunk_rows,
            compression=cfg.h5_compression,
            flush_every_s=cfg.flush_every_s,
        )
        if self.group is None:
            return LocalReplay(shard)
        return ShardedReplay(shard, self.group, self.timeout, seed=self.seed)
