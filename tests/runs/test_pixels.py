"""Pixels: the CNN encoder's presets (nature: the DQN paper's layers) and uint8 scaling inside the network; the
EnvPool backend (env.backend: envpool) with its autoreset, whole-game episode statistics and input errors;
configs/ppo_atari.yaml in one process and in the split layout. The EnvPool tests are skipped only where envpool is
not installed (CI installs the extra)."""

import importlib.util
import sys

import gymnasium as gym
import numpy as np
import pytest
import torch
from harness.launch import ROOT
from harness.runs import SPLIT4, assert_run_complete, run_main

from spmd_rl.config.loading import load_config
from spmd_rl.config.sections import EnvSection
from spmd_rl.envs.vector import make_vector_env, probe_env
from spmd_rl.modules.actor_critic import ActorCritic
from spmd_rl.modules.configs import ActorCriticConfig
from spmd_rl.modules.encoders import ImageEncoder, cnn_layers
from spmd_rl.modules.q_network import QNetwork
from spmd_rl.runtime.errors import UserError

ATARI = str(ROOT / "configs" / "ppo_atari.yaml")
DQN_ATARI = str(ROOT / "configs" / "dqn_atari.yaml")
FRAMES = gym.spaces.Box(0, 255, (4, 84, 84), np.uint8)
needs_envpool = pytest.mark.skipif(importlib.util.find_spec("envpool") is None, reason='pip install -e ".[envpool]"')


def convs(encoder: ImageEncoder) -> list[torch.nn.Conv2d]:
    return [m for m in encoder.conv if isinstance(m, torch.nn.Conv2d)]


def test_the_nature_preset_has_the_dqn_layers_and_512_features():
    policy = ActorCritic(FRAMES, gym.spaces.Discrete(4), ActorCriticConfig(cnn="nature", hidden_sizes=[]))
    layers = convs(policy.encoder)
    assert [(c.out_channels, c.kernel_size, c.stride, c.padding) for c in layers] == [
        (32, (8, 8), (4, 4), (0, 0)),
        (64, (4, 4), (2, 2), (0, 0)),
        (64, (3, 3), (1, 1), (0, 0)),
    ]
    assert policy.encoder.linear[0].in_features == 64 * 7 * 7  # 84 -> 20 -> 9 -> 7
    assert policy.encoder.out_features == 512
    assert policy.actor[0].in_features == 512 and len(policy.actor) == 1  # hidden_sizes [] : linear heads
    out = policy.act(torch.randint(0, 256, (5, 4, 84, 84), dtype=torch.uint8))
    assert out["action"].shape == (5,) and out["value"].shape == (5,)


def test_cnn_init_default_is_torchs_own_init_and_auto_keeps_the_nature_presets_orthogonal_init():
    """policy.cnn_init: the DQN Atari config takes torch's Conv2d/Linear init, as SB3's DQN does (its NatureCNN is
    not orthogonally initialized): the same draws as the layers made by hand under the same seed. auto (the
    default) keeps the nature preset's orthogonal init with zero biases."""
    cfg = load_config(DQN_ATARI)
    assert cfg.policy.cnn_init == "default"
    torch.manual_seed(3)
    encoder = QNetwork(FRAMES, gym.spaces.Discrete(4), cfg.policy).encoder
    torch.manual_seed(3)
    by_hand = [torch.nn.Conv2d(4, 32, 8, 4), torch.nn.Conv2d(32, 64, 4, 2), torch.nn.Conv2d(64, 64, 3, 1)]
    by_hand.append(torch.nn.Linear(64 * 7 * 7, 512))
    for ours, theirs in zip([*convs(encoder), encoder.linear[0]], by_hand, strict=True):
        assert torch.equal(ours.weight, theirs.weight) and torch.equal(ours.bias, theirs.bias)
    assert 0.03 < convs(encoder)[0].weight.std() < 0.04  # kaiming-uniform(a=sqrt 5): 1/sqrt(3 * 256) = 0.036

    auto = QNetwork(FRAMES, gym.spaces.Discrete(4), type(cfg.policy)(**{**vars(cfg.policy), "cnn_init": "auto"}))
    first = convs(auto.encoder)[0]
    assert 0.08 < first.weight.std() < 0.095 and not first.bias.any()  # orthogonal, gain sqrt(2): ~0.088
    small = ActorCritic(FRAMES, gym.spaces.Discrete(4), ActorCriticConfig(cnn_init="orthogonal")).encoder
    assert not convs(small)[0].bias.any()


def test_the_small_preset_stays_the_default_encoder():
    encoder = ActorCritic(FRAMES, gym.spaces.Discrete(4), ActorCriticConfig()).encoder
    assert [(c.out_channels, c.kernel_size, c.stride, c.padding) for c in convs(encoder)] == [
        (16, (3, 3), (1, 1), (1, 1)),
        (32, (3, 3), (2, 2), (1, 1)),
    ]
    assert encoder.out_features == 256


def test_kernels_strides_channels_and_features_override_the_preset():
    config = ActorCriticConfig(
        cnn="nature", cnn_channels=[8, 16], cnn_kernels=[5, 3], cnn_strides=[3, 1], cnn_features=64
    )
    layers, features = cnn_layers(config)
    assert [(layer.channels, layer.kernel, layer.stride) for layer in layers] == [(8, 5, 3), (16, 3, 1)]
    assert features == 64
    # the small preset extends to any depth: 3x3 kernels, stride 1 then 2
    layers, _ = cnn_layers(ActorCriticConfig(cnn_channels=[4, 8, 8]))
    assert [(layer.kernel, layer.stride) for layer in layers] == [(3, 1), (3, 2), (3, 2)]


def test_layer_lists_of_different_lengths_and_kernels_larger_than_the_image_are_user_errors():
    with pytest.raises(UserError, match="one value per conv layer"):
        cnn_layers(ActorCriticConfig(cnn="nature", cnn_channels=[8, 16]))
    tiny = gym.spaces.Box(0, 255, (12, 12, 3), np.uint8)
    with pytest.raises(UserError, match="shrink a 12x12 image to nothing"):
        ActorCritic(tiny, gym.spaces.Discrete(2), ActorCriticConfig(cnn="nature"))
    with pytest.raises(UserError, match="policy.cnn"):
        load_config(ATARI, ["policy.cnn=huge"])


def test_uint8_pixels_are_scaled_to_0_1_inside_the_network_and_channel_last_images_are_transposed():
    torch.manual_seed(0)
    chw = torch.randint(0, 256, (3, 4, 84, 84), dtype=torch.uint8)
    layers, features = cnn_layers(ActorCriticConfig(cnn="nature"))
    encoder = ImageEncoder(FRAMES, layers, features, orthogonal_init=True)
    expected = encoder.linear(encoder.conv(chw.to(torch.float32) / 255.0))
    torch.testing.assert_close(encoder(chw), expected)
    # the same frames as H x W x C (as most envs give them) through an encoder built for that layout
    hwc_space = gym.spaces.Box(0, 255, (84, 84, 4), np.uint8)
    hwc_encoder = ImageEncoder(hwc_space, layers, features)
    hwc_encoder.load_state_dict(encoder.state_dict())
    torch.testing.assert_close(hwc_encoder(chw.permute(0, 2, 3, 1)), expected)
    # float frames are taken as they are
    float_encoder = ImageEncoder(gym.spaces.Box(0.0, 1.0, (4, 84, 84), np.float32), layers, features)
    float_encoder.load_state_dict(encoder.state_dict())
    torch.testing.assert_close(float_encoder(chw.to(torch.float32) / 255.0), expected)


def test_the_atari_config_is_the_atari_ppo_recipe():
    cfg = load_config(ATARI)
    assert (cfg.env.id, cfg.env.backend, cfg.env.num_envs) == ("Breakout-v5", "envpool", 8)
    assert cfg.env.kwargs == {"episodic_life": True, "reward_clip": True}
    algo = cfg.algo
    assert (algo.num_steps, algo.update_epochs, algo.num_minibatches) == (128, 4, 4)
    assert (algo.learning_rate, algo.anneal_lr, algo.clip_coef) == (2.5e-4, True, 0.1)
    assert (algo.ent_coef, algo.vf_coef, algo.gamma, algo.gae_lambda, algo.max_grad_norm) == (
        0.01,
        0.5,
        0.99,
        0.95,
        0.5,
    )
    assert cfg.policy.cnn == "nature" and cfg.policy.hidden_sizes == []


def test_a_missing_envpool_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "envpool", None)  # import envpool raises ImportError
    with pytest.raises(UserError, match=r"env.backend=envpool needs the envpool package.*\.\[envpool\]"):
        probe_env(EnvSection(id="Breakout-v5", backend="envpool"))


@needs_envpool
@pytest.mark.parametrize(
    "env, match",
    [
        (EnvSection(id="Breakout-v4", backend="envpool"), r"env.id 'Breakout-v4' is not an EnvPool id \(similar: "),
        (EnvSection(id="my_envs:Maze-v0", backend="envpool"), "is not an EnvPool id"),
        (EnvSection(id="CartPole-v1", backend="envpool", kwargs={"bogus": 1}), "rejected env.kwargs"),
        (EnvSection(id="CartPole-v1", backend="envpool", vectorization="async"), "env.vectorization=async"),
    ],
)
def test_envpool_input_errors_are_user_errors_naming_the_key(env, match):
    with pytest.raises(UserError, match=match):
        probe_env(env)


@needs_envpool
def test_a_bad_envpool_id_stops_the_run_with_exit_2_and_one_line(tmp_path):
    result = run_main(f"run.dir={tmp_path}", "env.backend=envpool", "env.id=Nope-v0", timeout=120)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "env.id 'Nope-v0' is not an EnvPool id" in lines[0], result.stderr


@needs_envpool
def test_envpool_steps_with_next_step_autoreset_and_counts_whole_games():
    cfg = EnvSection(id="Breakout-v5", backend="envpool", num_envs=2, kwargs={"episodic_life": True})
    spec = probe_env(cfg)
    assert spec.observation_space == FRAMES and spec.vectorization == "envpool"
    envs, obs = make_vector_env(cfg, spec, seed=3)
    assert obs.shape == (2, 4, 84, 84) and obs.dtype == np.uint8
    rng = np.random.default_rng(0)
    ends = np.zeros(2, int)  # training episodes: each lost life
    counted = np.zeros(2, int)  # steps that are not resets
    resets_next = np.zeros(2, bool)
    games = []
    while len(games) < 2:
        obs, reward, terminated, truncated, info = envs.step(rng.integers(0, 4, 2))
        assert not reward[resets_next].any()  # the step after an end only resets (NEXT_STEP)
        counted += ~resets_next
        ends += terminated | truncated
        for i in np.flatnonzero(info.get("_episode", np.zeros(2, bool))):
            games.append((ends[i], int(info["episode"]["l"][i]), counted[i]))
            ends[i] = counted[i] = 0
        resets_next = terminated | truncated
    envs.close()
    for lives_lost, length, steps in games:
        assert lives_lost == 5  # one game = 5 lives = 5 training episodes
        assert length == steps


@needs_envpool
def test_ppo_atari_runs_in_one_process(tmp_path):
    result = run_main(
        "--config", ATARI, f"run.dir={tmp_path}", "train.total_steps=256", "algo.num_steps=16", "log.progress=false"
    )
    records = assert_run_complete(result, tmp_path, iterations=2)
    assert records[-1]["env_steps"] == 256
    assert "EnvPool's envs run in C++" in result.stdout  # the resume note


@needs_envpool
def test_dqn_atari_runs_and_learns_in_one_process(tmp_path):
    """configs/dqn_atari.yaml (the Nature CNN Q-network on EnvPool Breakout), shrunk: random steps, then updates."""
    overrides = ["train.total_steps=96", "algo.learning_starts=32", "algo.batch_size=8", "buffer.capacity=200"]
    result = run_main("--config", DQN_ATARI, f"run.dir={tmp_path}", *overrides, "log.progress=false")
    records = assert_run_complete(result, tmp_path, iterations=24, algo_metrics={"loss", "q_mean", "epsilon"})
    assert records[-1]["env_steps"] == 96 and records[-1]["epsilon"] < 1.0


@needs_envpool
@pytest.mark.slow
def test_ppo_atari_runs_split_over_4_ranks(tmp_path):
    result = run_main(
        "--config",
        ATARI,
        f"run.dir={tmp_path}",
        "train.total_steps=256",
        "algo.num_steps=16",
        "env.num_envs=4",
        *SPLIT4,
        "log.progress=false",
        nproc=4,
    )
    records = assert_run_complete(result, tmp_path, iterations=2)
    assert records[-1]["env_steps"] == 256


@needs_envpool
def test_envpool_envs_made_with_the_same_seed_step_alike():
    # CartPole: its start states are random (Breakout's frames differ little between seeds: ALE is deterministic
    # without sticky actions, and no-ops before the FIRE reset leave the screen as it is)
    cfg = EnvSection(id="CartPole-v1", backend="envpool", num_envs=2)
    spec = probe_env(cfg)
    actions = np.random.default_rng(0).integers(0, 2, (60, 2))

    def frames(seed):
        envs, obs = make_vector_env(cfg, spec, seed=seed)
        seen = [obs] + [envs.step(action)[0] for action in actions]
        envs.close()
        return np.stack(seen)

    assert np.array_equal(frames(5), frames(5))
    assert not np.array_equal(frames(5), frames(6))


@needs_envpool
@pytest.mark.slow
def test_an_envpool_run_stops_and_resumes_with_fresh_episodes(tmp_path):
    args = [
        "--config",
        ATARI,
        f"run.dir={tmp_path}",
        "env.num_envs=2",
        "algo.num_steps=16",
        "train.total_steps=64",
        "log.progress=false",
    ]
    stopped = run_main(*args, "run.stop_after_iterations=1")
    assert stopped.returncode == 75, stopped.stderr[-2000:]
    resumed = run_main(*args)
    assert_run_complete(resumed, tmp_path, iterations=2)
    assert "resuming from" in resumed.stdout and "a resume begins fresh episodes" in resumed.stdout
