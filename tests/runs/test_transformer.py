"""The built-in transformer policy (`policy.class: transformer`): tokens from vector, image and Dict observations,
its sizes (small defaults, ~1B on the meta device), the actor-critic's methods and outputs, its shard units, and
PPO training it through `python -m spmd_rl.main` in one process and split over 4 ranks."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch
from harness.parts import algo_cfg, make_ppo, rollout_batch
from harness.runs import SPLIT4, TINY, assert_run_complete, run_main

from spmd_rl.algorithms.ppo import ppo_losses, rollout_tensors, total_loss
from spmd_rl.config.loading import load_config
from spmd_rl.interfaces.context import Context
from spmd_rl.modules.configs import TransformerConfig
from spmd_rl.modules.normalizer import RunningNormalizer
from spmd_rl.modules.transformer import Block, TransformerPolicy
from spmd_rl.run.policies import load_policy
from spmd_rl.runtime.errors import UserError

CARTPOLE = gym.spaces.Box(-np.inf, np.inf, (4,), np.float32)
CATCH = gym.spaces.Box(0, 255, (10, 5, 1), np.uint8)  # examples/pixel_catch: H x W x C
MIXED = gym.spaces.Dict(
    {"pixels": gym.spaces.Box(0, 255, (3, 16, 16), np.uint8), "state": gym.spaces.Box(-1, 1, (6,), np.float32)}
)


def count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def block_size(width: int, mlp_width: int) -> int:
    attention = 3 * width * width + 3 * width + width * width + width
    mlp = width * mlp_width + mlp_width + mlp_width * width + width
    return attention + mlp + 4 * width  # and two LayerNorms


def sample(space: gym.Space, batch: int):
    if isinstance(space, gym.spaces.Dict):
        from tensordict import TensorDict

        return TensorDict({key: sample(sub, batch) for key, sub in space.spaces.items()}, batch_size=[batch])
    return torch.as_tensor(np.stack([space.sample() for _ in range(batch)]))


def test_the_default_policy_on_cartpole_is_one_token_and_a_readout_through_two_small_blocks():
    policy = TransformerPolicy(CARTPOLE, gym.spaces.Discrete(2), TransformerConfig())
    assert policy.tokens.tokens == 1 and policy.position.shape == (1, 2, 64)
    embedding = 4 * 64 + 64
    rest = 64 + 2 * 64 + 2 * 64 + (64 * 2 + 2) + (64 + 1)  # readout, positions, final norm, actor, critic heads
    assert count(policy) == embedding + 2 * block_size(64, 256) + rest == 100803
    assert policy.shard_units() == list(policy.blocks) and all(isinstance(b, Block) for b in policy.shard_units())


def test_vector_tokens_split_the_features_into_groups_each_with_its_own_embedding():
    policy = TransformerPolicy(CARTPOLE, gym.spaces.Discrete(2), TransformerConfig(vector_tokens=2, width=16, heads=2))
    assert policy.tokens.tokens == 2 and policy.tokens.weight.shape == (2, 2, 16)
    obs = torch.randn(3, 4)
    tokens = policy.tokens(obs)
    assert tokens.shape == (3, 2, 16)
    # token 1 reads features 2 and 3 only, through its own weights
    expected = obs[:, 2:] @ policy.tokens.weight[1] + policy.tokens.bias[1]
    torch.testing.assert_close(tokens[:, 1], expected)
    with pytest.raises(UserError, match=r"policy.vector_tokens=3 does not divide the 4 features.*\[1, 2, 4\]"):
        TransformerPolicy(CARTPOLE, gym.spaces.Discrete(2), TransformerConfig(vector_tokens=3))


def test_an_image_becomes_patches_zero_padded_to_a_multiple_of_the_patch():
    policy = TransformerPolicy(CATCH, gym.spaces.Discrete(3), TransformerConfig(patch_size=4, width=32))
    # 10 x 5 padded to 12 x 8: 3 x 2 patches of 4 x 4, from one channel
    assert policy.tokens.tokens == 6 and policy.position.shape == (1, 7, 32)
    assert policy.tokens.embed.weight.shape == (32, 1, 4, 4)
    frame = torch.zeros(1, 10, 5, 1, dtype=torch.uint8)
    frame[0, 9, 4, 0] = 255  # the bottom-right pixel: in the last patch (row 2, column 1) only
    tokens = policy.tokens(frame) - policy.tokens(torch.zeros_like(frame))
    changed = tokens.abs().sum(-1) > 0
    assert changed.tolist() == [[False] * 5 + [True]]
    # pixels scale to [0, 1]: 255 times the patch weight at (row 1, column 0) of that patch, divided by 255
    torch.testing.assert_close(tokens[0, 5], policy.tokens.embed.weight[:, 0, 1, 0])


def test_a_dict_observation_is_each_keys_tokens_in_key_order_with_their_own_embeddings():
    config = TransformerConfig(width=32, heads=4, patch_size=8, vector_tokens=2, normalize_obs=True)
    policy = TransformerPolicy(MIXED, gym.spaces.Box(-1, 1, (3,), np.float32), config)
    parts = policy.tokens.parts
    assert list(parts) == ["pixels", "state"]  # gymnasium sorts a Dict's keys
    assert parts["pixels"].tokens == 4 and parts["state"].tokens == 2 and policy.tokens.tokens == 6
    obs = sample(MIXED, 5)
    tokens = policy.tokens(obs)
    assert tokens.shape == (5, 6, 32)
    torch.testing.assert_close(tokens[:, 4:], parts["state"](obs["state"]))
    embedding = (3 * 8 * 8 * 32 + 32) + (6 * 32 + 2 * 32)
    rest = 32 + 7 * 32 + 2 * 32 + (32 * 3 + 3) + 33 + 3  # ..., actor, critic heads, log std
    assert count(policy) == embedding + 2 * block_size(32, 128) + rest
    with pytest.raises(UserError, match=r"features of the observation\['state'\]"):
        TransformerPolicy(MIXED, gym.spaces.Discrete(2), TransformerConfig(vector_tokens=4))


def test_about_a_billion_parameters_at_width_2048_depth_20_heads_16():
    config = TransformerConfig(width=2048, depth=20, heads=16)
    with torch.device("meta"):  # sizes only: no memory, no initialization arithmetic
        policy = TransformerPolicy(gym.spaces.Box(0, 255, (3, 64, 64), np.uint8), gym.spaces.Discrete(6), config)
    assert 0.95e9 < count(policy) < 1.05e9
    assert len(policy.shard_units()) == 20
    assert sum(count(b) for b in policy.shard_units()) == 20 * block_size(2048, 8192)


@pytest.mark.parametrize(
    "obs_space, action_space",
    [
        (CARTPOLE, gym.spaces.Discrete(2)),
        (CARTPOLE, gym.spaces.Box(-2, 2, (2,), np.float32)),
        (CATCH, gym.spaces.Discrete(3)),
        (MIXED, gym.spaces.Box(-1, 1, (3,), np.float32)),
    ],
    ids=["vector-discrete", "vector-box", "image-discrete", "dict-box"],
)
def test_act_and_evaluate_agree_and_every_parameter_learns(obs_space, action_space):
    torch.manual_seed(0)
    policy = TransformerPolicy(obs_space, action_space, TransformerConfig(width=32, depth=2, patch_size=4))
    obs = sample(obs_space, 7)
    with torch.no_grad():
        out = policy.act(obs)
        mode = policy.act(obs, deterministic=True)
    fields = policy.outputs()
    assert list(fields) == ["action", "log_prob", "value"]
    for name, field in fields.items():
        assert out[name].shape == (7, *field.shape) and out[name].dtype == field.dtype, name
    log_prob, entropy, value = policy(obs, out["action"])  # forward is evaluate
    torch.testing.assert_close(log_prob, out["log_prob"])
    torch.testing.assert_close(value, out["value"])
    torch.testing.assert_close(policy.value(obs), value)
    assert entropy.shape == (7,) and (entropy > 0).all()
    mode_log_prob = policy.evaluate(obs, mode["action"])[0]
    if isinstance(action_space, gym.spaces.Discrete):
        assert (mode_log_prob >= log_prob - 1e-6).all()  # the mode is the most likely action
    else:
        torch.testing.assert_close(mode["action"], policy.heads(obs)[0])  # the Gaussian's mean
    (log_prob.sum() + entropy.sum() + value.sum()).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in policy.parameters())


def test_normalize_obs_keeps_running_statistics_that_the_policy_applies():
    policy = TransformerPolicy(CARTPOLE, gym.spaces.Discrete(2), TransformerConfig(normalize_obs=True))
    normalizer = policy.tokens.features.normalizer
    assert isinstance(normalizer, RunningNormalizer) and normalizer.enabled
    obs = torch.randn(64, 4) * 5 + 3
    policy.update_normalizer(obs, Context.local(CARTPOLE, gym.spaces.Discrete(2)))
    assert normalizer.count.item() == 64
    torch.testing.assert_close(normalizer.mean.float(), obs.mean(0))
    assert "tokens.features.normalizer.mean" in policy.state_dict()  # ships with the weights, as model state
    off = TransformerPolicy(CARTPOLE, gym.spaces.Discrete(2), TransformerConfig())
    assert not off.tokens.features.normalizer.enabled


def test_bad_sizes_and_spaces_are_user_errors_naming_the_key():
    with pytest.raises(UserError, match=r"policy.heads=3 must divide policy.width=64"):
        TransformerPolicy(CARTPOLE, gym.spaces.Discrete(2), TransformerConfig(heads=3))
    with pytest.raises(UserError, match=r"action space MultiBinary.*transformer policy"):
        TransformerPolicy(CARTPOLE, gym.spaces.MultiBinary(3), TransformerConfig())
    with pytest.raises(UserError, match=r"observation space Discrete.*transformer policy"):
        TransformerPolicy(gym.spaces.Discrete(4), gym.spaces.Discrete(2), TransformerConfig())


def test_the_config_names_it_by_its_alias_with_its_own_keys():
    cfg = load_config(TINY, ["policy.class=transformer", "policy.width=32", "policy.depth=1"])
    assert cfg.classes["policy"] == "transformer"
    assert cfg.policy == TransformerConfig(width=32, depth=1)
    with pytest.raises(UserError, match="hidden_sizes"):
        load_config(TINY, ["policy.class=transformer", "policy.hidden_sizes=[8]"])


def test_ppos_update_starts_at_ratio_one_and_lowers_its_loss():
    torch.manual_seed(0)
    policy = TransformerPolicy(CARTPOLE, gym.spaces.Discrete(2), TransformerConfig(width=16, depth=1))
    batch = rollout_batch(policy)
    first = make_ppo(policy, algo_cfg(update_epochs=1, num_minibatches=1), num_iterations=10).update(batch, 0)
    assert first["clip_fraction"] == 0.0 and abs(first["approx_kl"]) < 1e-7  # act's log-probs are evaluate's
    cfg = algo_cfg(update_epochs=5, num_minibatches=2, anneal_lr=False, anneal_clip=False)
    data = rollout_tensors(batch)

    def loss() -> float:
        with torch.no_grad():
            return float(total_loss(ppo_losses(data, *policy.evaluate(data["obs"], data["action"]), 0.2, cfg), cfg))

    before = loss()
    assert make_ppo(policy, cfg, num_iterations=10).update(batch, iteration=0)["minibatch_steps"] == 10
    after = loss()
    assert after < before - 0.1


@pytest.mark.slow
def test_ppo_trains_it_in_one_process(tmp_path):
    result = run_main("--config", TINY, f"run.dir={tmp_path}", "policy.class=transformer", "policy.width=32")
    records = assert_run_complete(result, tmp_path, iterations=8)
    assert records[-1]["env_steps"] == 256 and records[-1]["episodes"] > 0
    policy, cfg = load_policy(tmp_path)  # policy.pt and config.yaml give the trained transformer back
    assert isinstance(policy, TransformerPolicy) and cfg.policy.width == 32
    assert policy.act(np.zeros(4, np.float32))["action"] in (0, 1)


@pytest.mark.slow
def test_ppo_trains_it_split_over_4_ranks_with_weights_verified_every_sync(tmp_path):
    result = run_main(
        "--config",
        TINY,
        f"run.dir={tmp_path}",
        "policy.class=transformer",
        "policy.width=32",
        "policy.vector_tokens=2",
        *SPLIT4,
        "weights.verify_every=1",
        nproc=4,
    )
    records = assert_run_complete(result, tmp_path, iterations=4)
    assert records[-1]["episodes"] > 0 and records[-1]["time_weight_sync_s"] > 0
