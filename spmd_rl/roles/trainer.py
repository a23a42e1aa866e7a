"""The trainer: receives the rollout segments of its env ranks, has its Algorithm learn from them (with its fellow
trainers: DDP over the trainer group), and publishes the new weights to the inference ranks (trainer 0).
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from tensordict import TensorDict

from spmd_rl.comm.sharding import full_state_dict, is_dtensor
from spmd_rl.config.excerpts import listed
from spmd_rl.interfaces.policy import CHUNK_VALID, GROUP, RECURRENT_STATE, Policy
from spmd_rl.persist.checkpoint import SHARDS_FROM, load_shards, stored_shapes
from spmd_rl.persist.rank_state import ALGORITHM, POLICY
from spmd_rl.persist.tensor_fit import fit_problems, shape_misfits, state_shape_misfits
from spmd_rl.roles.messages import SEGMENT_TIMINGS
from spmd_rl.roles.update_guard import UpdateGuard
from spmd_rl.runtime.distributed import bounded, comm_error, group_peer, is_comm_failure
from spmd_rl.runtime.errors import CommError, UserError
from spmd_rl.runtime.watchdog import COLLECTIVE_MARGIN_S, watchdog


class PolicyLagError(RuntimeError):
    """A step acted with weights older than the engine allows (0 versions in the sync engine, engine.max_policy_lag
    in the async one): an engine bug, never a user's."""


def combine_segments(segments: list[TensorDict], copy: bool = False) -> TensorDict:
    """The segments of several env ranks as one (env columns side by side); with copy, never a view of a
    receive buffer (one segment is cloned, several are concatenated anyway)."""
    if len(segments) == 1:
        return segments[0].clone() if copy else segments[0]
    combined = TensorDict(
        {
            "rollout": torch.cat([s["rollout"] for s in segments], dim=1),
            "next_obs": torch.cat([s["next_obs"] for s in segments]),
            "policy_version": segments[0]["policy_version"].clone() if copy else segments[0]["policy_version"],
            **{key: torch.cat([s[key] for s in segments]) for key in SEGMENT_TIMINGS},
        },
        batch_size=[],
    )
    if RECURRENT_STATE in segments[0].keys():  # a recurrent policy's first states, env columns side by side
        first = segments[0][RECURRENT_STATE]
        combined[RECURRENT_STATE] = TensorDict(
            {name: torch.cat([s[RECURRENT_STATE][name] for s in segments]) for name in first.keys()},
            batch_size=[],
        )
    return combined


def flushing_denormals() -> bool:
    """Whether this thread's CPU arithmetic flushes denormal floats to zero (torch.set_flush_denormal): a float32
    denormal made from a Python float comes out 0 then."""
    return torch.tensor(1e-39).item() == 0.0


class FlushDenormals:
    """A context in which this thread's CPU arithmetic flushes denormal floats to zero (torch.set_flush_denormal,
    x86 and ARM64; elsewhere a no-op), and after which it is as it was.

    Around every learn: Adam's first moments of ReLU units that stopped getting gradients decay by beta1 each step
    into denormals (below ~1.2e-38; over half of configs/dqn_cartpole.yaml's 256x256 layer after 20k steps), on
    which the CPU's arithmetic is many times slower (its fused Adam step: ~700 us instead of ~100 us). Flushed,
    those moments become 0 a few steps sooner, and the step they would have made (under lr * 1.2e-38 / eps,
    ~1e-33) moves no float32 weight above ~1e-26 either: seeded DQN, TD3, SAC and PPO runs kept the same metrics
    and policy.pt bit for bit (see the commit that added this). Only this thread is flushed (torch_threads > 1:
    intra-op workers keep their own setting); acting, env steps and evaluation are not."""

    def __init__(self):
        self.restore = False

    def __enter__(self) -> None:
        self.restore = not flushing_denormals() and torch.set_flush_denormal(True)

    def __exit__(self, *exc) -> None:
        if self.restore:
            torch.set_flush_denormal(False)


class Trainer:
    def __init__(
        self,
        algorithm,
        segment_channels: list,
        segment_sources: list[str],
        episode_slots: int,
        group,
        weight_sync=None,
        experience_log=None,
        describe: str = "trainer",
        timeout: datetime.timedelta = datetime.timedelta(seconds=300),
        skip_nonfinite_updates: bool = False,
        policy=None,
        column_groups: torch.Tensor | None = None,
        make_final_copy: Callable[[], Policy] | None = None,
        sharded: bool = False,
    ):
        self.algorithm = algorithm  # the user's (or a built-in) spmd_rl.api.Algorithm
        self.policy = policy if policy is not None else getattr(algorithm, "policy", None)
        self.segment_channels = segment_channels
        self.segment_sources = segment_sources  # who sends each segment, for error messages
        # Every trainer gathers the same fixed number of episode slots (the most env columns any trainer has).
        self.episode_slots = episode_slots
        self.group = group  # trainer group (None: a single trainer)
        self.weight_sync = weight_sync  # trainer rank 0 of a split layout only
        self.experience_log = experience_log
        self.describe = describe
        self.timeout = timeout  # bound on the trainer group's collectives (dist.timeout_s)
        self.update_guard = UpdateGuard(algorithm, skip_nonfinite_updates, describe, sharded=sharded)
        # With env groups: the group index of every env column of this trainer's segments (every env rank hosts
        # the same groups in the same order, so it follows from the config); None without groups.
        self.column_groups = column_groups
        self.learn_s = self.weight_sync_s = 0.0
        self.flush_denormals = FlushDenormals()
        # The parallel plan's sharded (train.parallel=fsdp): the policy's parameters are shards; checkpoints hold
        # them as such, and the full weights are gathered into final_copy (a plain policy on trainer 0's CPU: what
        # policy.pt is written from), which make_final_copy makes when they are first gathered, not at start.
        self.sharded = sharded
        self.make_final_copy = make_final_copy
        self.final_copy: Policy | None = None

    # -- one iteration -------------------------------------------------------------------------------------------

    def receive_segments(self, iteration: int, version: int) -> TensorDict:
        """Sync engine: one segment from each env rank, every step of it acted with `version`. A copy, never the
        receive buffer, which the next iteration's segment overwrites: an algorithm may keep what it learns from."""
        pending = [ch.irecv() for ch in self.segment_channels]
        segments = [message.wait() for message in pending]
        self.check_policy_lag(segments, version, 0, iteration)
        return combine_segments(segments, copy=True)

    def check_policy_lag(
        self, segments: list[TensorDict], freshest: int, bound: int, iteration: int
    ) -> dict[str, float]:
        """The lag of every step received for an iteration: versions behind `freshest`, the version the sync
        engine acts with; a step outside [freshest - bound, freshest] is a PolicyLagError naming its env rank."""
        lags = torch.cat([freshest - segment["policy_version"] for segment in segments])
        if not lags.numel():  # segments without steps (an algorithm without rollouts): nothing acted
            return {}
        worst = int(lags.max())
        if worst > bound or int(lags.min()) < 0:
            who = [
                name
                for name, segment in zip(self.segment_sources, segments)
                if bool(
                    ((freshest - segment["policy_version"]) > bound).any()
                    or (segment["policy_version"] > freshest).any()
                )
            ]
            raise PolicyLagError(
                f"{self.describe}: iteration {iteration}: segments from {who} acted with policy "
                f"versions outside [{freshest - bound}, {freshest}] (max_policy_lag {bound})"
            )
        return {"policy_lag_mean": float(lags.double().mean()), "policy_lag_max": float(worst)}

    def learn(self, segment: TensorDict, iteration: int) -> dict[str, float]:
        self.weight_sync_s = 0.0  # until this iteration's publish_weights
        clock = time.perf_counter()
        if self.experience_log is not None:
            rollout = segment["rollout"]
            if self.column_groups is not None:  # each row's group, logged beside the rollout's own fields
                rollout = rollout.clone(recurse=False)
                rollout[GROUP] = self.column_groups.to(torch.int16).expand(rollout.batch_size)
            # env_step counts primitive steps: a decision of an action chunk counts as its K (as env_steps does)
            chunk = rollout[CHUNK_VALID].shape[-1] if CHUNK_VALID in rollout.keys() else 1
            self.experience_log.append(
                rollout,
                policy_version=int(segment["policy_version"][0]),
                env_step=iteration * rollout.numel() * chunk,
                steps_per_row=chunk,
            )
        try:
            with (
                watchdog.watch(f"the algorithm's learn (iteration {iteration})", COLLECTIVE_MARGIN_S),
                self.flush_denormals,
            ):
                metrics = self.update_guard.learn(segment, iteration)
        except Exception as exc:
            # DDP's gradient all-reduce (FSDP2's all-gather and reduce-scatter when sharded) fails inside forward()
            # or backward() as a plain RuntimeError; bounded collectives raise CommError themselves. Anything else
            # is the algorithm's own error.
            if isinstance(exc, CommError) or not is_comm_failure(exc):
                raise
            fsdp = "FSDP2's parameter all-gather or gradient reduce-scatter"
            torchs = fsdp if self.sharded else "DDP's gradient all-reduce"
            raise comm_error(
                f"{self.describe}: learning (iteration {iteration}): a collective in the trainer group "
                f"({torchs} or the algorithm's own)",
                exc,
                self.timeout,
                group_peer(self.group) if self.group is not None else None,
            ) from exc
        self.learn_s = time.perf_counter() - clock
        return metrics

    def whole_policy(self) -> Policy | None:
        """The policy as one plain module (for policy.pt and for evaluating it): the policy itself when it is not
        sharded; when it is, its full weights gathered tensor by tensor into final_copy, a collective of the
        trainers (every trainer calls it), which trainer 0 returns and the others None."""
        if not self.sharded:
            return self.policy
        assert self.policy is not None  # a sharded trainer holds its shards of the policy
        full = full_state_dict(self.policy)  # trainer 0 gets the tensors
        if self.final_copy is None and self.make_final_copy is not None:
            self.final_copy = self.make_final_copy()
        if self.final_copy is not None:
            self.final_copy.load_state_dict(full)
        return self.final_copy

    def state_dict(self) -> dict:
        """What a checkpoint holds of this trainer: the policy, the algorithm's state, the experience log's rows.

        The log's staged rows are written and committed first, so the row count recorded is durable: a kill -9
        right after the checkpoint leaves a file that holds every row the checkpoint counts."""
        assert self.policy is not None  # a trainer that checkpoints has a policy
        log = self.experience_log
        if log is not None:
            log.flush()
        if self.sharded:  # DTensors, written shard by shard by the checkpoint store; the full weights for policy.pt
            policy = {k: v.detach() for k, v in self.policy.state_dict().items()}
            self.whole_policy()
        else:
            policy = {k: v.detach().clone() for k, v in self.policy.state_dict().items()}
        return {
            POLICY: policy,
            ALGORITHM: self.algorithm.state_dict(),
            "experience_rows": log.total_rows if log is not None else -1,
        }

    def check_state_dict(self, state: dict) -> None:
        """What the load would refuse with a traceback, said first (alone, before the sharded load's collective):
        a UserError naming the checkpoint's policy tensors that are missing, unexpected or of another shape than
        this run's policy (a checkpoint of another config's run)."""
        assert self.policy is not None  # a trainer that checkpoints has a policy
        directory = Path(state[SHARDS_FROM]) if SHARDS_FROM in state else None
        stored = stored_shapes(state[POLICY], directory)
        expected = {key: tuple(value.shape) for key, value in self.policy.state_dict().items()}
        problems = fit_problems(
            [key for key in expected if key not in stored],
            [key for key in stored if key not in expected],
            shape_misfits(expected, stored),
            [],
            "tensor",
            "the checkpoint",
        )
        if problems:
            raise UserError(
                f"the checkpoint's policy does not fit this run's: {'; '.join(problems)}; resume with the config "
                f"that wrote it, or start from its weights where they fit (run.init_from, run.init_prefix)"
            )
        optimizers = {
            name: value for name, value in vars(self.algorithm).items() if isinstance(value, torch.optim.Optimizer)
        }
        misfits = state_shape_misfits(self.algorithm.state_dict(), state[ALGORITHM], optimizers, ALGORITHM)
        if misfits:
            raise UserError(
                f"the checkpoint's algorithm state does not fit this run's: {len(misfits)} misfit(s): "
                f"{listed(misfits)}; resume with the config and the version of algo.class "
                f"'{type(self.algorithm).__name__}' that wrote it, or start from its weights (run.init_from)"
            )

    def load_state_dict(self, state: dict) -> None:
        assert self.policy is not None  # a trainer that checkpoints has a policy
        if SHARDS_FROM in state:  # shard files, read into DTensors laid out over this run's trainers
            like = next(p for p in self.policy.parameters() if is_dtensor(p))
            state = load_shards(state, Path(state[SHARDS_FROM]), like)
        self.policy.load_state_dict(state[POLICY])
        self.algorithm.load_state_dict(state[ALGORITHM])
        if self.experience_log is not None:
            self.experience_log.rewind(state["experience_rows"])

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
        # One value per finished episode: its return and length; its group (env groups) and its success flags
        # (envs that report one) where they exist.
        episodes = {
            "returns": rollout["episode_return"][done].double(),
            "lengths": rollout["episode_length"][done].double(),
        }
        if self.column_groups is not None:
            episodes["groups"] = self.column_groups.expand(done.shape)[done].double()
        if "episode_success" in rollout.keys():
            episodes["successes"] = rollout["episode_success"][done].double()
            episodes["successes_at_end"] = rollout["episode_success_at_end"][done].double()
        local = {
            **episodes,
            **{key: segment[key].sum().item() for key in SEGMENT_TIMINGS},
            "env_ranks": float(segment["env_s"].numel()),
        }
        if self.group is None or dist.get_world_size(self.group) == 1:
            return local
        # Fixed-size tensors (padded with NaN) so the gather needs no negotiation of sizes.
        slots = self.episode_slots
        blocks = len(episodes)
        sums_at = [*SEGMENT_TIMINGS, "env_ranks"]
        packed = torch.full((blocks * slots + len(sums_at),), float("nan"), dtype=torch.float64)
        count = local["returns"].numel()
        for block, values in enumerate(episodes.values()):
            packed[block * slots : block * slots + count] = values
        packed[blocks * slots :] = torch.tensor([local[key] for key in sums_at], dtype=torch.float64)
        gathered = [torch.empty_like(packed) for _ in range(dist.get_world_size(self.group))]
        bounded(
            dist.all_gather,
            gathered,
            packed,
            group=self.group,
            timeout=self.timeout,
            what="all_gather of episode statistics in the trainer group",
        )
        if dist.get_rank(self.group) != 0:
            return None
        merged = torch.stack(gathered)
        finished = ~merged[:, :slots].isnan()
        sums = merged[:, blocks * slots :].sum(0)
        statistics: dict[str, torch.Tensor | float] = {
            name: merged[:, block * slots : (block + 1) * slots][finished] for block, name in enumerate(episodes)
        }
        statistics.update({key: sums[i].item() for i, key in enumerate(sums_at)})
        return statistics
