"""Sharded trainers build the policy on the meta device, shard it and take only their own rows of trainer 0's
built policy (sharding.fill_shards): gathered back, on both trainers, the weights and buffers are bit for bit those
of the policy each would have built whole with the same seed, its tied tensors still tied, for the actor-critic and
for the vla preset (a language head tied to the embeddings, non-persistent buffers, LoRA adapters); trainer 1
constructs no policy to get them. Real gloo ranks."""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
import torch.distributed as dist
from harness.multiproc import assert_all_ok, run_ranks

import spmd_rl.modules.pretrained as pretrained
from spmd_rl.api import Policy
from spmd_rl.comm import sharding
from spmd_rl.config.loading import load_config
from spmd_rl.envs.vector import probe_env
from spmd_rl.run.contract import load_classes
from spmd_rl.run.policies import build_policy, policy_on_meta, policy_tensors

VLA = ["env.id=tests.harness.vla_fixtures:InstructedReach-v0", "policy.class=vla", "policy.preset=tiny"]


def _fill(rank: int, world_size: int, overrides: list[str], own_rows: bool = False) -> None:
    cfg = load_config(None, overrides)
    spec = probe_env(cfg.env)
    policy_cls = load_classes(cfg)[0]
    before = Policy.real_constructions
    module = policy_on_meta(cfg, spec, policy_cls)
    files = module.file_sources() if own_rows else {}
    assert bool(files) == own_rows
    sharding.shard_policy(module, dist.group.WORLD, torch.device("cpu"), [], bf16=False)
    module.to_empty(device="cpu")
    source = None
    if rank == 0:
        copy = pretrained._copy
        if own_rows:  # trainer 0 builds it without reading the folder; each trainer reads its own rows
            pretrained._copy = _no_read
        with pretrained.reading_deferred() if own_rows else contextlib.nullcontext():
            source = dict(policy_tensors(build_policy(cfg, spec, policy_cls)))
        pretrained._copy = copy
    readers = {name: functools.partial(pretrained.read_rows, where) for name, where in files.items()}
    sharding.fill_shards(module, source, dist.group.WORLD, src=0, files=readers)
    # every parameter by its own name (a class's state-dict hooks rename some), gathered from both trainers' rows
    gathered = {name: p.full_tensor() for name, p in module.named_parameters(remove_duplicate=False)}
    if rank == 1:
        assert Policy.real_constructions == before  # its shards came from trainer 0
    whole = build_policy(cfg, spec, policy_cls)  # the unsharded path, in this process (its threads, its library)
    expected = dict(whole.named_parameters(remove_duplicate=False))
    assert gathered.keys() == expected.keys()
    assert [k for k, v in expected.items() if not torch.equal(gathered[k], v)] == []
    buffers = dict(whole.named_buffers(remove_duplicate=False))  # non-persistent ones too
    received = dict(module.named_buffers(remove_duplicate=False))
    assert received.keys() == buffers.keys() and all(torch.equal(received[k], v) for k, v in buffers.items())
    assert len(list(module.parameters())) == len(list(whole.parameters()))  # tied tensors stay one parameter


def _no_read(*args, **kwargs):
    raise AssertionError("trainer 0 read the folder's tensors whole")


@pytest.mark.parametrize("overrides", [[], [*VLA, "policy.lora.rank=4"]], ids=["actor-critic", "vla-tiny-lora"])
def test_shards_filled_from_trainer_0_gather_back_to_the_policy_built_whole_with_the_same_seed(overrides):
    if overrides:
        pytest.importorskip("peft")
    assert_all_ok(run_ranks(_fill, 2, overrides, timeout_s=120))


@pytest.mark.parametrize("lora", [0, 4], ids=["full", "lora"])
def test_a_pretrained_folder_read_row_by_row_on_each_trainer_gathers_back_to_the_policy_built_whole(tmp_path, lora):
    # trainer 0 builds the policy without reading the folder; each trainer reads only its own rows of each of its
    # tensors (the language head tied to the embeddings, LoRA's base_layer names); the heads come from trainer 0
    pytest.importorskip("peft")
    from harness.vla_fixtures import make_model_folder

    folder = make_model_folder(tmp_path / "model")
    overrides = [VLA[0], "policy.class=vla", f"policy.pretrained={folder}", f"policy.lora.rank={lora}"]
    assert_all_ok(run_ranks(_fill, 2, overrides, True, timeout_s=120))
