"""Pretrained weights: `run.init_from` takes a .safetensors file, `run.init_prefix` loads one into a submodule, and
every mismatch (missing or unexpected keys, shapes, dtypes) is a one-line UserError (exit 2) naming the keys, for
safetensors and torch files alike."""

from __future__ import annotations

import pytest
import torch
from harness.runs import TINY
from safetensors.torch import save_file

import spmd_rl
from spmd_rl.config.loading import load_config
from spmd_rl.config.plugins import POLICY, load_class
from spmd_rl.envs.vector import probe_env
from spmd_rl.run.policies import build_policy
from spmd_rl.run.state_fit import fit_state_dict, load_fitted
from spmd_rl.runtime.errors import UserError

# lr 0: the run's updates leave the weights it started from exactly as they were, so they can be compared
FROZEN_RUN = {"algo.learning_rate": 0.0, "train.total_steps": 32}


def cartpole_policy(seed: int = 1):
    cfg = load_config(None, [f"train.seed={seed}"])
    return build_policy(cfg, probe_env(cfg.env), load_class(POLICY, cfg.classes["policy"]))


def weights_of(policy, prefix: str = "") -> dict[str, torch.Tensor]:
    return {k[len(prefix) :]: v.contiguous().clone() for k, v in policy.state_dict().items() if k.startswith(prefix)}


def test_a_safetensors_file_starts_a_run(tmp_path):
    donor = weights_of(cartpole_policy(seed=7))
    save_file(donor, tmp_path / "donor.safetensors")
    run = spmd_rl.train(
        TINY, {"run.dir": tmp_path / "run", "run.init_from": tmp_path / "donor.safetensors", **FROZEN_RUN}
    )
    loaded = run.policy.state_dict()
    assert all(torch.equal(loaded[k], donor[k]) for k in donor if "normalizer" not in k)


def test_a_prefix_loads_one_submodule_and_the_rest_keeps_its_initialization(tmp_path):
    donor = weights_of(cartpole_policy(seed=7), "actor.")  # the file's names: 0.weight, 0.bias, ...
    save_file(donor, tmp_path / "actor.safetensors")
    # the same actor under the file's own prefix, beside tensors that are not read at all
    nested = {f"backbone.{k}": v for k, v in donor.items()} | {"head.w": torch.zeros(3), "other": torch.ones(2)}
    save_file(nested, tmp_path / "nested.safetensors")
    fresh = spmd_rl.train(TINY, {"run.dir": tmp_path / "fresh", **FROZEN_RUN}).policy.state_dict()
    for file, prefix in (("actor.safetensors", "actor."), ("nested.safetensors", "actor.:backbone.")):
        overrides = {"run.init_from": tmp_path / file, "run.init_prefix": prefix, **FROZEN_RUN}
        loaded = spmd_rl.train(TINY, {"run.dir": tmp_path / prefix, **overrides}).policy.state_dict()
        assert all(torch.equal(loaded[f"actor.{k}"], v) for k, v in donor.items())
        assert all(torch.equal(loaded[k], fresh[k]) for k in fresh if k.startswith("critic."))
        assert not torch.equal(fresh["actor.0.weight"], donor["0.weight"])  # so the first check means something


def error_of(state, prefix: str = "") -> str:
    with pytest.raises(UserError) as caught:
        fit_state_dict(cartpole_policy(), state, prefix)
    return str(caught.value)


def test_each_mismatch_names_its_keys():
    state = weights_of(cartpole_policy())
    missing = {k: v for k, v in state.items() if not k.startswith("critic.")}
    assert (
        "missing 6 key(s) the policy has: critic.0.weight, critic.0.bias, critic.2.weight, critic.2.bias and 2 more"
        in error_of(missing)
    )
    assert "1 unexpected key(s) of the file: extra.w" in error_of(state | {"extra.w": torch.zeros(1)})
    assert "1 shape mismatch(es): actor.4.bias (3,) (the policy's (2,))" in error_of(
        state | {"actor.4.bias": torch.zeros(3)}
    )
    assert (
        "1 dtype mismatch(es) (convert the file's tensors): actor.4.bias torch.bfloat16 (the policy's torch.float32)"
        in error_of(state | {"actor.4.bias": state["actor.4.bias"].bfloat16()})
    )
    actor = weights_of(cartpole_policy(), "actor.")
    line = error_of({k: v for k, v in actor.items() if k != "0.bias"} | {"x": torch.zeros(1)}, "actor.")
    assert "missing 1 key(s) the policy has: actor.0.bias" in line and "unexpected key(s) of the file: x" in line
    assert "file key K was read as policy key actor.K (run.init_prefix=actor.)" in line
    assert "the policy has no weights under 'decoder.' (its top-level names: encoder, actor, critic)" in error_of(
        actor, "decoder."
    )
    assert "no key of the file starts with 'backbone.'" in error_of(actor, "actor.:backbone.")
    assert "must end with '.'" in error_of(actor, "actor")
    policy = cartpole_policy()
    before = weights_of(policy)
    with pytest.raises(UserError):
        load_fitted(policy, state | {"actor.4.bias": torch.zeros(3)})
    assert all(torch.equal(policy.state_dict()[k], v) for k, v in before.items())  # checked before any copy


def test_a_mismatched_torch_file_is_a_user_error_naming_the_key(tmp_path):
    state = weights_of(cartpole_policy())
    state["actor.0.weight"] = torch.zeros(64, 5)
    torch.save(state, tmp_path / "policy.pt")  # the torch-file path checks the same way
    with pytest.raises(UserError) as caught:  # exit 2 from the command line
        spmd_rl.train(TINY, {"run.dir": tmp_path / "run", "run.init_from": tmp_path / "policy.pt"})
    line = str(caught.value)
    assert "\n" not in line and "policy.pt: its weights do not fit policy.class 'actor_critic'" in line
    assert "1 shape mismatch(es): actor.0.weight (64, 5) (the policy's (64, 4))" in line
    with pytest.raises(UserError, match="run.init_prefix=actor. needs run.init_from"):
        spmd_rl.train(TINY, {"run.dir": tmp_path / "other", "run.init_prefix": "actor."})


def test_the_weights_load_before_the_policy_is_sharded(tmp_path):
    donor = weights_of(cartpole_policy(seed=7), "actor.")  # names of the unsharded policy, as files have them
    save_file(donor, tmp_path / "actor.safetensors")
    overrides = {"run.init_from": tmp_path / "actor.safetensors", "run.init_prefix": "actor.", **FROZEN_RUN}
    run = spmd_rl.train(TINY, {"run.dir": tmp_path / "run", "train.parallel": "fsdp", **overrides})
    loaded = run.policy.state_dict()
    assert all(torch.equal(loaded[f"actor.{k}"], v) for k, v in donor.items())


def test_a_lora_layout_mismatch_is_one_sentence_saying_what_to_change():
    # fault pass 6, V6: a full fine-tune's policy.pt into a LoRA policy listed 48 keys; the layouts differ (peft's
    # base_layer / lora_A / lora_B names), not the weights, and the line says so and what to set
    lora = torch.nn.Module()
    lora.q = torch.nn.Module()
    lora.q.base_layer = torch.nn.Linear(4, 4)
    lora.q.lora_A = torch.nn.ModuleDict({"default": torch.nn.Linear(4, 2, bias=False)})
    lora.q.lora_B = torch.nn.ModuleDict({"default": torch.nn.Linear(2, 4, bias=False)})
    plain = torch.nn.Module()
    plain.q = torch.nn.Linear(4, 4)
    with pytest.raises(UserError, match=r"without LoRA adapters .* start from a LoRA run .* set policy.lora.rank=0"):
        fit_state_dict(lora, plain.state_dict())
    with pytest.raises(UserError, match=r"with LoRA adapters .* and this policy has none: 2 key\(s\) of the policy"):
        fit_state_dict(plain, lora.state_dict())
    with pytest.raises(UserError, match=r"missing .*q\.weight"):  # any other misfit still lists its keys
        fit_state_dict(plain, {"other.weight": torch.zeros(4, 4)})
