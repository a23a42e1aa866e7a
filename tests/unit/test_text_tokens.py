"""Text observations become token ids on the env rank (envs/text.py): bytes and a local tokenizer file, the id
dtype, once per episode, the errors; and the built-in policies act on them (the transformer ignores the padding)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from harness import instructed_env  # noqa: F401  (registers Instructed-v0)

from spmd_rl.config.loading import load_config
from spmd_rl.config.plugins import POLICY, load_class
from spmd_rl.envs.spaces import zeros_of
from spmd_rl.envs.text import TokenizedText, token_dtype
from spmd_rl.envs.vector import make_vector_env, probe_env
from spmd_rl.run import contract
from spmd_rl.run.policies import build_policy
from spmd_rl.runtime.errors import UserError

ENV = "env.id=tests.harness.instructed_env:Instructed-v0"
WORDS = ["reach", "the", "red", "blue", "target"]


def config(*overrides: str):
    return load_config(None, [ENV, "env.num_envs=2", *overrides])


def word_tokenizer(folder, extra_words: int = 0):
    """A WordLevel tokenizer of WORDS (and `extra_words` more), saved as folder/tokenizer.json."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    words = ["[UNK]", *WORDS, *(f"w{i}" for i in range(extra_words))]
    tokenizer = Tokenizer(WordLevel({word: i for i, word in enumerate(words)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = Whitespace()
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder / "tokenizer.json"


def test_id_dtype_is_the_smallest_that_holds_the_vocabulary():
    assert token_dtype(256) == np.uint8
    assert token_dtype(257) == np.int16
    assert token_dtype(32768) == np.int16
    assert token_dtype(32769) == np.int32
    assert token_dtype(2**31 + 1) == np.int64


def test_bytes_are_the_default_tokens():
    cfg = config("env.max_text_tokens=32")
    spec = probe_env(cfg.env)
    space = spec.observation_space["instruction"]
    assert isinstance(space, TokenizedText) and space.vocab_size == 256
    envs, obs = make_vector_env(cfg.env, spec, seed=0)
    try:
        text = obs["instruction"]
        assert text["ids"].dtype == np.uint8 and text["ids"].shape == (2, 32) and text["mask"].dtype == np.uint8
        for ids, mask in zip(text["ids"], text["mask"]):
            assert bytes(ids[mask.astype(bool)]).decode() in ("reach the red target", "reach the blue target")
            assert mask.sum() == len("reach the red target") or mask.sum() == len("reach the blue target")
            assert not mask[int(mask.sum()) :].any() and not ids[int(mask.sum()) :].any()  # zeros after the text
        assert isinstance(zeros_of(spec.observation_space, 3)["instruction"]["ids"], torch.Tensor)
    finally:
        envs.close()


@pytest.mark.parametrize("as_folder", [False, True])
def test_a_local_tokenizer_file_or_its_folder(tmp_path, as_folder):
    file = word_tokenizer(tmp_path)
    cfg = config(f"env.tokenizer={tmp_path if as_folder else file}", "env.max_text_tokens=6")
    spec = probe_env(cfg.env)
    assert spec.observation_space["instruction"].vocab_size == len(WORDS) + 1
    envs, obs = make_vector_env(cfg.env, spec, seed=0)
    try:
        ids, mask = obs["instruction"]["ids"], obs["instruction"]["mask"]
        assert ids.dtype == np.uint8
        for row, row_mask in zip(ids, mask):
            assert row_mask.tolist() == [1, 1, 1, 1, 0, 0]
            assert [WORDS[i - 1] for i in row[:4]] in (
                ["reach", "the", "red", "target"],
                ["reach", "the", "blue", "target"],
            )
    finally:
        envs.close()


def test_a_large_vocabulary_travels_as_int16(tmp_path):
    cfg = config(f"env.tokenizer={word_tokenizer(tmp_path, extra_words=300)}", "env.max_text_tokens=4")
    spec = probe_env(cfg.env)
    assert spec.observation_space["instruction"]["ids"].dtype == np.int16
    envs, obs = make_vector_env(cfg.env, spec, seed=0)
    envs.close()
    assert obs["instruction"]["ids"].dtype == np.int16


def test_an_instruction_is_tokenized_once_per_episode():
    cfg = config()
    envs, _ = make_vector_env(cfg.env, probe_env(cfg.env), seed=0)
    tokenizer = envs.tokenizer  # the TokenizeText wrapper is outermost
    encoded = []
    encode = tokenizer.encode
    tokenizer.encode = lambda text: encoded.append(text) or encode(text)
    try:
        episodes = 0
        for _ in range(4 * instructed_env.EPISODE_STEPS):
            _, _, terminated, truncated, _ = envs.step(np.zeros(2, dtype=np.int64))
            episodes += int((terminated | truncated).sum())
    finally:
        envs.close()
    # An env's instruction is encoded when it changes: at most once per new episode, never on the other steps.
    assert episodes == 6 and 0 < len(encoded) <= episodes


def test_text_longer_than_max_text_tokens_names_the_length_it_needs():
    cfg = config("env.max_text_tokens=8")
    # "reach the red target" is 20 bytes, the blue one 21: whichever env's instruction comes first is named
    with pytest.raises(UserError, match=r"is (20|21) tokens, longer than env.max_text_tokens=8; set env.max_text_tok"):
        make_vector_env(cfg.env, probe_env(cfg.env), seed=0)


def test_a_tokenizer_path_that_does_not_exist():
    # a short path: the message clips a long value (pytest-xdist's tmp_path) to its ends
    cfg = config("env.tokenizer=/nonexistent-spmd-rl/missing.json")
    with pytest.raises(UserError, match=r"env.tokenizer=.*missing.json: no such file or folder"):
        probe_env(cfg.env)


@pytest.mark.parametrize("policy", ["actor_critic", "transformer", "spmd_rl.modules.recurrent:RecurrentActorCritic"])
def test_the_built_in_policies_act_on_text(policy):
    overrides = [f"policy.class={policy}"]
    if "recurrent" in policy:
        overrides.append("algo.class=spmd_rl.algorithms.recurrent_ppo:RecurrentPPO")
    cfg = config(*overrides)
    policy_cls, algorithm_cls, _, _ = contract.load_classes(cfg)
    contract.check_policy(cfg, probe_env(cfg.env), policy_cls, algorithm_cls)


def test_the_transformer_ignores_the_padding_after_a_text():
    cfg = config("policy.class=transformer", "env.max_text_tokens=24")
    spec = probe_env(cfg.env)
    policy = build_policy(cfg, spec, load_class(POLICY, cfg.classes["policy"]))
    obs = zeros_of(spec.observation_space, 1)
    obs["instruction"]["ids"][0, :5] = torch.tensor(list(b"reach"), dtype=torch.uint8)
    obs["instruction"]["mask"][0, :5] = 1
    padded = obs.clone()
    padded["instruction"]["ids"][0, 5:] = 7  # what lies past the mask must not matter
    with torch.no_grad():
        assert torch.allclose(policy.value(obs), policy.value(padded))
        changed = obs.clone()
        changed["instruction"]["ids"][0, 0] = 7
        assert not torch.allclose(policy.value(obs), policy.value(changed))


def test_a_policy_whose_action_shape_is_not_the_action_space_s():
    cfg = load_config(None, ["env.id=Pendulum-v1"])
    spec = probe_env(cfg.env)
    policy_cls, algorithm_cls, _, _ = contract.load_classes(cfg)
    outputs = policy_cls.outputs

    class ChunkDeclaring(policy_cls):
        def outputs(self):
            declared = outputs(self)
            return {**declared, "action": dataclasses.replace(declared["action"], shape=(4, 1))}

    with pytest.raises(UserError, match=r"declares 'action' of shape \(4, 1\), but the action space .* shape \(1,\)"):
        contract.check_policy(cfg, spec, ChunkDeclaring, algorithm_cls)
    # With env.action_chunk 4 the same declaration is the chunk's; one action per decision is then refused.
    chunked_cfg = load_config(None, ["env.id=Pendulum-v1", "env.action_chunk=4"])
    chunked_spec = probe_env(chunked_cfg.env)
    contract.check_policy(chunked_cfg, chunked_spec, ChunkDeclaring, algorithm_cls)

    class OneActionDeclaring(policy_cls):
        def outputs(self):
            declared = outputs(self)
            return {**declared, "action": dataclasses.replace(declared["action"], shape=(1,))}

    with pytest.raises(UserError, match=r"shape \(1,\), but the action space .* shape \(4, 1\) \(a chunk of env"):
        contract.check_policy(chunked_cfg, chunked_spec, OneActionDeclaring, algorithm_cls)


def test_the_transformer_attends_to_every_token_of_a_nested_dict_without_text():
    import gymnasium as gym

    from spmd_rl.modules.configs import TransformerConfig
    from spmd_rl.modules.transformer import make_tokens

    box = gym.spaces.Box(-1, 1, (4,), np.float32)
    space = gym.spaces.Dict({"a": gym.spaces.Dict({"x": box}), "y": box})
    tokens = make_tokens(space, TransformerConfig())
    obs = zeros_of(space, 3)
    mask = tokens.attention_mask(obs)
    assert mask is None or (mask.shape == (3, tokens.tokens) and bool(mask.all()))
