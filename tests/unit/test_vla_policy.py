"""The vla policy (modules/vla.py) and pretrained folders (modules/pretrained.py): a tiny PaliGemma folder made by
save_pretrained in shards loads tensor for tensor as transformers loads it; acting with the Gaussian and the bins
head, action chunks, images resized; every bad folder and LoRA target a one-line UserError; LoRA trains only the
adapters and heads; policy.pt merged or as adapters reads back into the same function; the presets' sizes."""

from __future__ import annotations

import json
import os
import shutil

import gymnasium as gym
import numpy as np
import pytest
import torch
from harness.vla_fixtures import VOCAB_SIZE, InstructedReach, make_model_folder

from spmd_rl.envs import spaces
from spmd_rl.modules.configs import LoraConfig, VLAConfig
from spmd_rl.modules.vla import ACTION_BINS, VLAPolicy, paligemma_name
from spmd_rl.runtime.errors import UserError

ENV = InstructedReach()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_model_folder(tmp_path_factory.mktemp("paligemma"))


def copy_of(folder, tmp_path):
    return shutil.copytree(folder, tmp_path / "model")


def observations(batch: int = 3):
    obs = spaces.zeros_of(ENV.observation_space, batch)
    for i in range(batch):
        ENV.reset(seed=i)
        spaces.write(spaces.numpy_views(obs), ENV.step(ENV.action_space.sample())[0], i)
    return obs


def build(folder=None, **knobs) -> VLAPolicy:
    torch.manual_seed(0)
    return VLAPolicy(ENV.observation_space, ENV.action_space, VLAConfig(pretrained=str(folder or ""), **knobs))


def rewrite_shard(folder, edit) -> None:
    """Apply edit(tensors) to the shard holding the language model's final norm."""
    from safetensors.torch import load_file, save_file

    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shard = folder / index["weight_map"]["language_model.model.norm.weight"]
    tensors = load_file(shard)
    edit(tensors)
    save_file(tensors, shard, metadata={"format": "pt"})


def test_a_sharded_folder_loads_every_tensor_as_transformers_loads_it(folder):
    from transformers import PaliGemmaForConditionalGeneration

    assert len(list(folder.glob("model-*.safetensors"))) > 1 and (folder / "model.safetensors.index.json").is_file()
    reference = PaliGemmaForConditionalGeneration.from_pretrained(folder).state_dict()
    loaded = build(folder).backbone.state_dict()
    compared = [key for key in reference if not key.startswith("model.vision_tower.head.")]  # the unbuilt pooling
    assert set(compared) == set(loaded) and len(compared) > 50
    assert all(torch.equal(reference[key], loaded[key]) for key in compared)


def test_a_single_file_folder_and_the_original_checkpoint_names_load_too(folder, tmp_path):
    from transformers import PaliGemmaForConditionalGeneration

    model = PaliGemmaForConditionalGeneration.from_pretrained(folder)
    model.save_pretrained(tmp_path / "single")
    assert (tmp_path / "single" / "model.safetensors").is_file()
    assert torch.equal(build(tmp_path / "single").backbone.lm_head.weight, model.lm_head.weight)
    # model hubs' PaliGemma files name the vision tower's tensors under vision_tower.vision_model.
    assert paligemma_name("vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight") == (
        "model.vision_tower.encoder.layers.0.mlp.fc1.weight"
    )
    assert paligemma_name("vision_tower.head.probe") is None


@pytest.mark.parametrize("head", ["gaussian", "bins"])
def test_acting_gives_actions_their_log_probs_and_values_that_evaluate_reproduces(folder, head):
    policy = build(folder, action_head=head)
    obs = observations()
    assert policy.image_size == 16 and ENV.observation_space["image"].shape == (20, 20, 3)  # resized
    with torch.no_grad():
        out = policy.act(obs)
        again = policy.act(obs, deterministic=True)
    assert out["action"].shape == (3, 2) and out["log_prob"].shape == out["value"].shape == (3,)
    assert torch.equal(again["action"], policy.act(obs, deterministic=True)["action"])
    log_prob, entropy, value = policy.evaluate(obs, out["action"])
    torch.testing.assert_close(log_prob, out["log_prob"])
    torch.testing.assert_close(value, out["value"])
    assert entropy.shape == (3,) and log_prob.requires_grad
    if head == "bins":  # each action is a bin's centre within the bounds
        bins = (out["action"] + 1) / 2 * ACTION_BINS - 0.5
        torch.testing.assert_close(bins, bins.round())
        assert policy.backbone.config.text_config.vocab_size == VOCAB_SIZE


def test_an_action_chunk_is_k_actions_from_one_forward(folder):
    torch.manual_seed(0)
    chunk_space = gym.spaces.Box(np.tile(ENV.action_space.low, (3, 1)), np.tile(ENV.action_space.high, (3, 1)))
    policy = VLAPolicy(ENV.observation_space, chunk_space, VLAConfig(pretrained=str(folder)))
    assert policy.outputs()["action"].shape == (3, 2) and policy.action_queries.shape[0] == 6
    obs = observations(2)
    with torch.no_grad():
        out = policy.act(obs)
    assert out["action"].shape == (2, 3, 2)
    torch.testing.assert_close(policy.evaluate(obs, out["action"])[0], out["log_prob"])


def test_the_shard_units_are_the_vision_and_decoder_layers(folder):
    policy = build(folder)
    inner = policy.backbone.model
    assert policy.shard_units() == [*inner.vision_tower.encoder.layers, *inner.language_model.layers]
    assert len(policy.shard_units()) == 4


@pytest.mark.parametrize("preset, low, high", [("tiny", 3e6, 7e6), ("small", 70e6, 130e6), ("base", 2.5e9, 3.2e9)])
def test_the_presets_sizes_on_the_meta_device(preset, low, high):
    with torch.device("meta"):
        policy = VLAPolicy(ENV.observation_space, ENV.action_space, VLAConfig(preset=preset))
    assert low < sum(p.numel() for p in policy.parameters()) < high


def test_a_folder_without_config_json_is_refused(folder, tmp_path):
    copy = copy_of(folder, tmp_path)
    (copy / "config.json").unlink()
    with pytest.raises(UserError, match="holds no config.json"):
        build(copy)
    with pytest.raises(UserError, match="is not a folder"):
        build(tmp_path / "nowhere")


@pytest.mark.parametrize("instead", [None, "a FIFO"])
def test_an_index_naming_a_missing_file_is_refused(folder, tmp_path, instead):
    copy = copy_of(folder, tmp_path)
    shard = sorted(copy.glob("model-*.safetensors"))[1]
    shard.unlink()
    if instead:
        os.mkfifo(shard)  # there, but no file to read (fault pass 6, V4: it was "not in the folder")
    said = f" \\({shard.name} is {instead}\\)" if instead else ""
    with pytest.raises(UserError, match=f"names 1 file.* not regular files in the folder: {shard.name}{said}; copy"):
        build(copy)


def test_a_folder_without_weights_or_of_another_model_type_is_refused(folder, tmp_path):
    copy = copy_of(folder, tmp_path)
    for file in copy.glob("model*.safetensors*"):
        file.unlink()
    with pytest.raises(UserError, match="holds neither model.safetensors nor model.safetensors.index.json"):
        build(copy)
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps(config | {"model_type": "llava"}))
    with pytest.raises(UserError, match="model_type is 'llava'"):
        build(copy)


def test_a_tensor_of_another_shape_or_dtype_is_named(folder, tmp_path):
    copy = copy_of(folder, tmp_path)
    rewrite_shard(copy, lambda t: t.update({"language_model.model.norm.weight": torch.zeros(7)}))
    with pytest.raises(UserError, match=r"1 shape mismatch\(es\): language_model.model.norm.weight \(7,\)"):
        build(copy)
    rewrite_shard(copy, lambda t: t.update({"language_model.model.norm.weight": torch.zeros(32, dtype=torch.float64)}))
    with pytest.raises(UserError, match=r"dtype mismatch\(es\): language_model.model.norm.weight float64"):
        build(copy)


def test_missing_and_unexpected_tensors_are_named(folder, tmp_path):
    copy = copy_of(folder, tmp_path)

    def rename(tensors):
        tensors["language_model.model.final_norm.weight"] = tensors.pop("language_model.model.norm.weight")

    rewrite_shard(copy, rename)
    with pytest.raises(UserError) as caught:
        build(copy)
    message = str(caught.value)
    assert "missing 1 tensor(s) the policy has: model.language_model.norm.weight" in message
    assert "1 unexpected tensor(s) of the files: language_model.model.final_norm.weight" in message
    assert "\n" not in message


def test_instruction_ids_beyond_the_vocabulary_are_refused():
    import gymnasium as gym
    import numpy as np

    space = gym.spaces.Dict(
        ENV.observation_space.spaces
        | {
            "instruction": gym.spaces.Dict(
                {"ids": gym.spaces.Box(0, 5000, (4,), np.int64), "mask": gym.spaces.Box(0, 1, (4,), np.uint8)}
            )
        }
    )
    with pytest.raises(UserError, match="goes up to 5000, but the decoder's vocabulary has 4096"):
        VLAPolicy(space, ENV.action_space, VLAConfig())
    with pytest.raises(UserError, match="policy.state_key=pose is not a key of the observation"):
        VLAPolicy(ENV.observation_space, ENV.action_space, VLAConfig(state_key="pose"))


def test_lora_targets_that_match_nothing_are_refused(folder):
    with pytest.raises(UserError, match=r"policy.lora.target_modules=\['attention_query'\] match no layer.*q_proj"):
        build(folder, lora=LoraConfig(rank=4, target_modules=["attention_query"]))


def test_lora_trains_only_the_adapters_and_the_heads(folder):
    policy = build(folder, lora=LoraConfig(rank=4, target_modules=["q_proj", "v_proj"]))
    trainable = {name for name, p in policy.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in name or not name.startswith("backbone.") for name in trainable)
    assert {"action_queries", "log_std", "mean_head.weight", "value_head.weight", "state_token.weight"} <= trainable
    before = {key: value.clone() for key, value in policy.state_dict().items()}
    optimizer = torch.optim.Adam([p for p in policy.parameters() if p.requires_grad], lr=1e-2)
    obs = observations()
    for _ in range(2):  # lora_B starts at zero, so lora_A's first gradient is zero
        optimizer.zero_grad()
        log_prob, entropy, value = policy(obs, torch.zeros(3, 2))
        (value.square().mean() - log_prob.mean() - entropy.mean()).backward()
        optimizer.step()
    changed = {key for key, value in policy.state_dict().items() if not torch.equal(value, before[key])}
    assert changed == trainable


def perturbed_lora_policy(folder, save: str) -> VLAPolicy:
    policy = build(folder, lora=LoraConfig(rank=4, save=save))
    with torch.no_grad():  # lora_B starts at zero: give the adapters an effect
        for name, parameter in policy.named_parameters():
            if ".lora_B." in name:
                parameter.normal_(0, 0.1)
    return policy


def test_a_merged_policy_file_is_a_policy_without_lora_and_reads_back_into_one_with_it(folder):
    policy = perturbed_lora_policy(folder, "merged")
    state = policy.file_state()
    assert not any(".lora_" in key or ".base_layer." in key for key in state)
    plain = build(folder)
    plain.load_state_dict(state)
    obs = observations()
    with torch.no_grad():
        expected = policy.act(obs, deterministic=True)
        torch.testing.assert_close(plain.act(obs, deterministic=True), expected)
        fresh = build(folder, lora=LoraConfig(rank=4))
        fresh.load_state_dict(fresh.from_file_state(state))
        torch.testing.assert_close(fresh.act(obs, deterministic=True), expected)


def test_an_adapters_policy_file_holds_only_what_trains_and_reads_back_on_the_pretrained_base(folder):
    policy = perturbed_lora_policy(folder, "adapters")
    state = policy.file_state()
    assert set(state) == {name for name, p in policy.named_parameters() if p.requires_grad}
    fresh = build(folder, lora=LoraConfig(rank=4, save="adapters"))
    fresh.load_state_dict(fresh.from_file_state(state))
    obs = observations()
    with torch.no_grad():
        torch.testing.assert_close(fresh.act(obs, deterministic=True), policy.act(obs, deterministic=True))
    checkpoint = policy.state_dict()  # a checkpoint's full layout passes as it is
    assert fresh.from_file_state(checkpoint) is checkpoint
