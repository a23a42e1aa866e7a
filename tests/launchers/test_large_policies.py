"""Policies that outgrow one device: FSDP2 trainers (train.parallel=fsdp), bf16, weight sync from shards, frozen
parameters sent once, sharded checkpoints with exact resume. Real gloo ranks and real runs of spmd_rl.main."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from harness.launch import job_env
from harness.multiproc import run_ranks
from harness.parts import FrozenEncoderNet, learn_and_publish, save_full_weights
from harness.runs import assert_fsdp_equals_ddp, assert_resumed_byte_for_byte, assert_weights_close, run_main

from spmd_rl.comm import sharding
from spmd_rl.comm.weight_sources import GatheredWeightSource
from spmd_rl.comm.weights import WeightSync

TINY = ["--config", "configs/ci_tiny.yaml", "train.seed=3"]
SPLIT5 = ["layout.mode=split", "layout.trainer=2", "layout.inference=1", "layout.env=2", "train.total_steps=512"]


def _env() -> dict:
    return job_env(PYTHONWARNINGS="ignore")


def main(*args, nproc: int = 0, timeout: float = 300) -> subprocess.CompletedProcess:
    return run_main(*args, nproc=nproc, timeout=timeout, env=_env())


def metrics_without_timings(run_dir: Path) -> list[dict]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [
        {k: v for k, v in r.items() if not (k.startswith("time_") or "sps" in k or k.endswith("_s"))} for r in records
    ]


# -- weight sync from shards (unit, real gloo ranks) -------------------------------------------------------------


def _sharded_sync(rank: int, world_size: int, out: str, wire: str) -> None:
    """Ranks 0 and 1 are FSDP trainers, rank 2 an inference rank; the weight group is ranks 0 and 2."""
    trainers = dist.new_group([0, 1])
    weights = dist.new_group([0, 2])
    wire_dtype = torch.bfloat16 if wire == "bf16" else None
    net = FrozenEncoderNet()
    bucket_bytes = 4096  # several buckets
    if rank == 2:
        if wire_dtype is not None:
            sharding.cast_parameters(net, wire_dtype)
        sync = WeightSync(net, weights, src=0, me=2, bucket_bytes=bucket_bytes, timeout=30)
        first = sync.buckets_to_send()
        assert sync.broadcast(-1) == 7
        second = sync.buckets_to_send()
        # The frozen encoder's buckets come with the first broadcast only.
        assert len(second) < len(first)
        sent_later = sum(sync.bucket_sizes[i] for i in second)
        frozen = sum(e.nbytes for e in sync.entries if e.frozen)
        assert sum(sync.bucket_sizes) - sent_later >= frozen
        torch.save({"first": {k: v.clone() for k, v in net.state_dict().items()}}, f"{out}/received1.pt")
        assert sync.broadcast(-1) == 8
        sync.verify(8)
        torch.save({k: v.clone() for k, v in net.state_dict().items()}, f"{out}/received2.pt")
        return
    sharding.shard_policy(net, trainers, torch.device("cpu"), [], bf16=False)
    trainable = [p for p in net.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(trainable, lr=0.01)
    source = GatheredWeightSource(
        net, weights if rank == 0 else None, src=0, me=rank, bucket_bytes=bucket_bytes, timeout=30,
        wire_dtype=wire_dtype,
    )  # fmt: skip
    for version in (7, 8):
        learn_and_publish(net, optimizer, source, rank, version)
        save_full_weights(net, rank, f"{out}/trainer{version}.pt")
    source.verify(8)


@pytest.mark.parametrize("wire", ["fp32", "bf16"])
def test_inference_rank_holds_the_gathered_full_weights_and_frozen_ones_are_sent_once(tmp_path, wire):
    import torch.optim  # noqa: F401 - imported by the parent so the forked ranks need not (torch._dynamo: seconds)

    assert run_ranks(_sharded_sync, 3, str(tmp_path), wire, timeout_s=60) == [0, 0, 0]
    for version, received in (
        (7, torch.load(tmp_path / "received1.pt")["first"]),
        (8, torch.load(tmp_path / "received2.pt")),
    ):
        full = torch.load(tmp_path / f"trainer{version}.pt")
        assert sorted(full) == sorted(received)
        for key, value in full.items():
            expected = value.to(torch.bfloat16) if wire == "bf16" and value.dtype == torch.float32 else value
            assert received[key].dtype == expected.dtype, key
            assert torch.equal(received[key], expected), f"{key} at version {version}"
    # The encoder is frozen: the same after both syncs; the head moved.
    first, second = torch.load(tmp_path / "trainer7.pt"), torch.load(tmp_path / "trainer8.pt")
    assert torch.equal(first["encoder.0.weight"], second["encoder.0.weight"])
    assert not torch.equal(first["head.0.weight"], second["head.0.weight"])


# -- runs --------------------------------------------------------------------------------------------------------


def test_layout_refusals_are_one_line_exit_2(tmp_path):
    cases = [([*TINY, "inference.dtype=bf16"], "inference.dtype=bf16 is for the inference ranks")]
    for args, expected in cases:
        result = main(*args, f"run.dir={tmp_path / 'r'}", "--dry-run", timeout=120)
        assert result.returncode == 2, result.stdout + result.stderr
        assert expected in result.stderr, result.stderr
        assert "Traceback" not in result.stderr


def test_eval_every_evaluates_the_gathered_policy_of_two_sharded_trainers(tmp_path):
    """eval.every with fsdp: every trainer takes part in gathering the whole policy, rank 0 evaluates it, and
    checkpoint.keep_best saves that whole policy."""
    args = [*TINY, "train.parallel=fsdp", "eval.every=2", "eval.episodes=2", "checkpoint.keep_best=true"]
    result = main(*args, f"run.dir={tmp_path}", nproc=2)
    assert result.returncode == 0, result.stdout + result.stderr
    evaluated = [r for r in metrics_without_timings(tmp_path) if "eval_return_mean" in r]
    assert [r["iteration"] for r in evaluated] == [1, 3]
    best = torch.load(tmp_path / "best" / "policy.pt", weights_only=True)
    final = torch.load(tmp_path / "policy.pt", weights_only=True)
    assert best.keys() == final.keys() and not any(type(v).__name__ == "DTensor" for v in best.values())


@pytest.mark.slow
def test_fsdp_equals_ddp_on_the_same_data_colocated_two_ranks(tmp_path):
    """Same seeds, same envs, same batches: FSDP2's sharded update is DDP's replicated one within float error."""
    assert_fsdp_equals_ddp([*TINY, "train.total_steps=512"], tmp_path, nproc=2, timeout=300, env=_env())
    # ... and the same learning curve (the losses are computed from the same numbers).
    a, b = metrics_without_timings(tmp_path / "ddp"), metrics_without_timings(tmp_path / "fsdp")
    assert [r["episodes"] for r in a] == [r["episodes"] for r in b]


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout,nproc",
    [([], 0), (SPLIT5, 5)],
    ids=["one-process", "split5-two-fsdp-trainers"],
)
def test_fsdp_resume_is_exact(tmp_path, layout, nproc):
    """N iterations in one go equal N/2, a stop and a resume: metrics and policy.pt byte for byte, with the
    parameters and Adam state sharded into DCP files (and bf16 on the wire in the split layout)."""
    extra = ["train.parallel=fsdp", *layout] + (["inference.dtype=bf16", "weights.verify_every=1"] if nproc else [])
    whole = main(*TINY, *extra, f"run.dir={tmp_path / 'whole'}", nproc=nproc)
    assert whole.returncode == 0, whole.stdout + whole.stderr
    iterations = len(metrics_without_timings(tmp_path / "whole"))
    half = main(
        *TINY, *extra, f"run.dir={tmp_path / 'halves'}", f"run.stop_after_iterations={iterations // 2}", nproc=nproc
    )
    assert half.returncode == 75 if not nproc else half.returncode != 0, half.stdout + half.stderr
    shards = list((tmp_path / "halves" / "checkpoints").glob("iter_*/shards/*.distcp"))
    assert len(shards) == (2 if nproc else 1)
    resumed = main(*TINY, *extra, f"run.dir={tmp_path / 'halves'}", nproc=nproc)
    assert_resumed_byte_for_byte(resumed, tmp_path / "whole", tmp_path / "halves", metrics_without_timings)


@pytest.mark.slow
def test_bf16_compute_runs_and_its_policy_evaluates_in_float32(tmp_path):
    result = main(*TINY, "train.precision=bf16", f"run.dir={tmp_path}")
    assert result.returncode == 0, result.stdout + result.stderr
    policy = torch.load(tmp_path / "policy.pt", weights_only=True)
    assert all(v.dtype != torch.bfloat16 for v in policy.values())  # master weights stay float32
    assert all(r["policy_loss"] == r["policy_loss"] for r in metrics_without_timings(tmp_path))  # no NaN


@pytest.mark.slow
def test_fsdp_resume_reshards_two_ranks_to_one_and_back(tmp_path):
    """A sharded checkpoint of 2 trainers resumes on 1 (the model and Adam state resharded by DCP), that one's on 2
    again, and the run completes with every iteration logged once; a DDP checkpoint is still refused."""
    run_dir = tmp_path / "run"
    args = [*TINY, "train.parallel=fsdp", "env.total_envs=4", "train.total_steps=1024", f"run.dir={run_dir}"]
    first = main(*args, "run.stop_after_iterations=6", nproc=2)
    assert "stopped by run.stop_after_iterations=6" in first.stdout + first.stderr, first.stdout + first.stderr
    one = main(*args, "run.stop_after_iterations=11")
    assert one.returncode == 75, one.stdout + one.stderr
    assert "was saved by 2 rank(s) (colocated), this run has 1" in one.stdout and "data order differs" in one.stdout
    two = main(*args, nproc=2)
    assert two.returncode == 0, two.stdout + two.stderr
    assert "was saved by 1 rank(s) (colocated), this run has 2" in two.stdout
    records = metrics_without_timings(run_dir)
    assert [r["iteration"] for r in records] == list(range(16))
    assert [r["env_steps"] for r in records] == [64 * (i + 1) for i in range(16)]
    policy = torch.load(run_dir / "policy.pt", weights_only=True)
    assert all(torch.isfinite(v).all() for v in policy.values() if v.is_floating_point())

    ddp_dir = tmp_path / "ddp"
    ddp = [*TINY, "env.total_envs=4", "train.total_steps=1024", f"run.dir={ddp_dir}"]
    main(*ddp, "run.stop_after_iterations=6", nproc=2)
    refused = main(*ddp)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "only train.parallel=fsdp checkpoints reshard" in refused.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    "args,nproc",
    [
        (["--config", "configs/ppo_cartpole_recurrent.yaml", "train.total_steps=1024"], 0),
        (
            [
                "--config",
                "configs/ppo_cartpole_async.yaml",
                "layout.trainer=2",
                "layout.env=2",
                "train.total_steps=2048",
            ],
            5,
        ),
    ],
    ids=["recurrent-ppo-one-process", "async-engine-split5-bf16-wire"],
)
def test_fsdp_runs_recurrent_ppo_and_the_async_engine(tmp_path, args, nproc):
    extra = ["inference.dtype=bf16", "weights.verify_every=1"] if nproc else []
    result = main(*args, "train.parallel=fsdp", *extra, f"run.dir={tmp_path}", "log.progress=false", nproc=nproc)
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "finished.json").exists() and (tmp_path / "policy.pt").exists()
    assert list((tmp_path / "checkpoints").glob("iter_*/shards/.metadata"))


@pytest.mark.slow
def test_hybrid_sharding_equals_ddp_on_four_ranks(tmp_path):
    """train.shard_group_size=2 over 4 trainers: shards within pairs, replicas across them (a 2-D mesh), the same
    update as DDP within float error, its checkpoint written as shards."""
    runs = {"ddp": [], "hybrid": ["train.parallel=fsdp", "train.shard_group_size=2"]}
    for name, extra in runs.items():
        result = main(*TINY, "train.total_steps=512", *extra, f"run.dir={tmp_path / name}", nproc=4)
        assert result.returncode == 0, result.stdout + result.stderr
    assert_weights_close(tmp_path / "ddp", tmp_path / "hybrid")
    assert list((tmp_path / "hybrid" / "checkpoints").glob("iter_*/shards/.metadata"))
    refused = main(*TINY, "train.parallel=fsdp", "train.shard_group_size=3", f"run.dir={tmp_path / 'r'}", nproc=2)
    assert "train.shard_group_size=3 does not divide the 2 trainers" in refused.stderr, refused.stderr
