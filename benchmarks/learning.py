"""Env steps and wall time until CartPole-v1 is solved (mean of the last 20 episode returns >= 475).

    python benchmarks/learning.py [--seeds 5 | --seed-list 5,6] [--layouts one,colocated2,split8] [--no-sb3]

spmd_rl runs its default config as a user would; Stable-Baselines3 PPO runs the same hyperparameters, read from
that default config, in this process (needs the bench extra). Wall time is training time: from the first
iteration (spmd_rl: its metrics' wall_s; SB3: learn()) to the solving iteration, imports and start-up excluded.

A config over seeds, beside the published numbers (the seed runner):

    nice -n 19 python benchmarks/learning.py --config configs/mujoco/ppo_halfcheetah.yaml --seeds 3 \
        --out /work/bench28 [--parallel 2] [--report-only] [section.key=value ...]

runs `python -m spmd_rl.main` once per seed (train.seed = 1..N), --parallel at a time, each in its own run directory
OUT/<config name>[+<overrides>]/seed<N> (its console in seed<N>.log beside it), then prints one table: the final
deterministic evaluation (the config's eval.every must evaluate the last iteration) and the mean of the last 20
training episodes, mean +- std over the seeds, beside the published numbers; the same table and the versions go to
OUT/<...>/results.md. A stopped or killed benchmark resumes by rerunning the same command: finished seeds are
skipped, unfinished ones rerun with their run directory, which resumes them from their last checkpoint as any run
does. --report-only prints the table of what has finished so far.

Each finished seed also leaves a small results file, RESULTS/<config name>[+<overrides>]/seed<N>.json (RESULTS:
--results, by default benchmarks/results/ of this checkout, committed to git): its final evaluation, the mean of its
last 20 training episodes, env steps, wall time, versions, date and load average. The skip of finished seeds and
--report-only read these files first, so a later session on a fresh machine (only git persists) reruns only the
seeds that have none. No checkpoints go there.

--sb3 (DQN, PPO, SAC and TD3 configs; needs the bench extra) runs Stable-Baselines3's DQN, PPO, SAC or TD3 beside
each seed, in the same benchmark run, with the config's hyperparameters translated key by key (sb3_kwargs; what has
no translation is refused) and the same seed and budget: its final deterministic evaluation (10 episodes) and last
20 training episodes, in RESULTS/<...>/sb3_seed<N>.json, as one more row of the table. PPO's observation and reward
normalization is SB3's VecNormalize as RL Zoo's `normalize: true` wraps the env; its evaluation uses the training
statistics, frozen, and raw rewards, as the zoo's does. A DQN config on an Atari game through EnvPool
(configs/dqn_atari.yaml) is played on SB3's side by ALE's <Game>NoFrameskip-v4 under SB3's AtariWrapper and a
4-frame VecFrameStack, with CnnPolicy: EnvPool's settings (its defaults, then env.kwargs) translated key by key
(sb3_atari; ale-py and OpenCV come with the bench extra). Both sides report whole-game scores.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from common import ROOT, machine, run_spmd, table, versions, versions_line

from spmd_rl.config.loading import load_config
from spmd_rl.persist.run_files import FINISHED, METRICS_FILE

SOLVED = 475.0
BUDGET = 100_000
WINDOW = 20
# Env steps between the saves of an SB3 run of the seed runner (sb3_learn); the environment may set it (a test).
SB3_SAVE_EVERY = int(os.environ.get("SB3_SAVE_EVERY", 25_000))

LAYOUTS = {
    # name: (torchrun processes (0 = plain python), config, overrides) — all with 8 envs in all, 256 steps/iteration
    "one": (0, None, []),
    "colocated2": (2, None, ["env.num_envs=4"]),
    "split8": (8, "configs/ppo_cartpole_split.yaml", []),
    "async6": (6, "configs/ppo_cartpole_async.yaml", []),  # async engine, V-trace, max_policy_lag 2
    # Large-policy paths (docs/large-policies.md) on the same default config:
    "one-bf16": (0, None, ["train.precision=bf16"]),
    "colocated2-fsdp": (2, None, ["env.num_envs=4", "train.parallel=fsdp"]),
}


def spmd_solve(layout: str, seed: int) -> dict:
    nproc, config, overrides = LAYOUTS[layout]
    records = run_spmd(overrides + [f"train.seed={seed}", f"train.total_steps={BUDGET}"], nproc=nproc, config=config)
    solved = next((r for r in records if (r["episode_return_mean"] or 0) >= SOLVED), None)
    return {
        "steps": solved["env_steps"] if solved else None,
        "wall_s": solved["wall_s"] if solved else None,
        "final": records[-1]["episode_return_mean"],
    }


def sb3_solve(seed: int) -> dict:
    from stable_baselines3 import PPO
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.env_util import make_vec_env

    class StopWhenSolved(BaseCallback):
        solved_at = None
        solved_wall = None

        def _on_step(self) -> bool:
            returns = [e["r"] for e in list(self.model.ep_info_buffer)[-WINDOW:]]
            if self.solved_at is None and len(returns) == WINDOW and sum(returns) / WINDOW >= SOLVED:
                self.solved_at, self.solved_wall = self.num_timesteps, time.perf_counter() - start
            return self.solved_at is None

    # The default config's values, so that both sides always run the same settings (SB3's MlpPolicy is the same
    # 64x64 tanh actor and critic, with Adam eps 1e-5 as ours).
    cfg = load_config(None)
    algo = cfg.algo
    assert cfg.env.id == "CartPole-v1" and not algo.clip_value_loss and algo.target_kl is None
    assert cfg.policy.hidden_sizes == [64, 64] and cfg.policy.activation == "tanh" and not cfg.policy.normalize_obs
    torch.set_num_threads(1)
    env = make_vec_env("CartPole-v1", n_envs=cfg.env.num_envs, seed=seed)
    kwargs = ppo_kwargs(cfg, torch.nn.Tanh)  # the seed runner's translation, key by key
    assert kwargs.pop("normalize") is None  # no VecNormalize: the default config normalizes nothing
    model = PPO("MlpPolicy", env, seed=seed, device="cpu", **kwargs)
    callback = StopWhenSolved()
    start = time.perf_counter()
    model.learn(total_timesteps=BUDGET, callback=callback)
    returns = [e["r"] for e in list(model.ep_info_buffer)[-WINDOW:]]
    return {"steps": callback.solved_at, "wall_s": callback.solved_wall, "final": sum(returns) / len(returns)}


def fmt(value, digits=1):
    return "-" if value is None else (f"{value:.{digits}f}" if isinstance(value, float) else str(value))


# ---------------------------------------------------------------------------------------------------------------
# A config over seeds, beside the published numbers

# (source, its mean, its std). RL Zoo: benchmark.md of rl-baselines3-zoo (commit 22e3ff2): one trained agent per
# task (v3), its deterministic evaluation over ~150k steps; that std is over its episodes, not over seeds. CleanRL:
# its ppo_continuous_action (untuned) on v4, as issue 28 quotes it.
PUBLISHED = {
    "ppo_halfcheetah": [
        ("RL Zoo PPO, HalfCheetah-v3, 1M", 5819.1, 663.5),
        ("CleanRL PPO, HalfCheetah-v4", 1442.6, 46.0),
    ],
    "ppo_hopper": [("RL Zoo PPO, Hopper-v3, 1M", 2410.4, 10.0)],
    "ppo_walker2d": [("RL Zoo PPO, Walker2d-v3, 1M", 3478.8, 821.7)],
    "sac_halfcheetah": [("RL Zoo SAC, HalfCheetah-v3, 1M", 9535.5, 100.5)],
    "sac_hopper": [("RL Zoo SAC, Hopper-v3, 1M", 2325.5, 1129.7)],
    "sac_walker2d": [("RL Zoo SAC, Walker2d-v3, 1M", 3863.2, 254.3)],
    "dqn_cartpole": [("RL Zoo DQN, CartPole-v1, 50k", 500.0, 0.0)],
    "td3_pendulum": [("RL Zoo TD3, Pendulum-v1, 20k", -151.9, 90.2)],
    "td3_halfcheetah": [("RL Zoo TD3, HalfCheetah-v3, 1M", 9655.7, 969.9)],
}


def bench_dir(out: Path, config: Path, overrides: list[str]) -> Path:
    """OUT/<config stem>[+<overrides>]: other overrides are other runs (a run directory resumes only its config)."""
    tag = "+".join(re.sub(r"[^A-Za-z0-9_.=-]", "_", o) for o in overrides)
    return out / (config.stem + (f"+{tag}" if tag else ""))


def results_file(results: Path, where: Path, seed: int, who: str = "") -> Path:
    """RESULTS/<config name>[+<overrides>]/[<who>_]seed<N>.json: a finished seed's numbers, kept in git."""
    return results / where.name / f"{who + '_' if who else ''}seed{seed}.json"


def write_result(path: Path, result: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    record = {**result, "versions": versions(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    path.write_text(json.dumps({**record, "load_at_end": load}, indent=1) + "\n")


def run_seed(config: Path, seed: int, where: Path, overrides: list[str], timeout_s: float, results: Path) -> int:
    """One seed's run, resumed if its directory holds an unfinished one; its exit code (0: finished)."""
    run_dir = where / f"seed{seed}"
    saved = results_file(results, where, seed)
    if saved.exists():
        print(f"seed {seed}: finished before, skipped ({saved})", flush=True)
        return 0
    if (run_dir / FINISHED).exists():
        print(f"seed {seed}: finished before, skipped ({run_dir})", flush=True)
        write_result(saved, {"seed": seed, **seed_result(run_dir)})
        return 0
    resuming = (run_dir / METRICS_FILE).exists()
    cmd = [sys.executable, "-m", "spmd_rl.main", "--config", str(config.resolve()), *overrides]
    cmd += [f"train.seed={seed}", f"run.dir={run_dir}", "log.progress=false"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    print(f"seed {seed}: {'resuming' if resuming else 'starting'} in {run_dir}", flush=True)
    with open(where / f"seed{seed}.log", "a") as log:
        log.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} {versions_line()}\n$ {' '.join(cmd)}\n")
        log.flush()
        try:
            run = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            print(f"seed {seed}: still running after --timeout-h, killed (rerun to resume it)", flush=True)
            return 124
    code = run.returncode
    print(f"seed {seed}: exit {code}" + ("" if code == 0 else f" (see {where}/seed{seed}.log; rerun to resume)"))
    if code == 0:
        (run_dir / "versions.json").write_text(json.dumps(versions()) + "\n")
        write_result(saved, {"seed": seed, **seed_result(run_dir)})
    return code


def sb3_kwargs(cfg) -> tuple[str, dict]:
    """SB3's algorithm name and keyword arguments for this config's DQN, PPO, SAC or TD3 hyperparameters, key by key.

    SB3's train_freq counts env steps per env (as algo.num_steps does), gradient_steps the updates after each
    train_freq (algo.updates_per_step of every env step of all envs). SB3's DQN has no Double DQN (it takes the max
    over its target network): a config with algo.double=true is compared with SB3's plain target."""
    algo, policy = cfg.algo, cfg.policy
    activation = {"relu": torch.nn.ReLU, "tanh": torch.nn.Tanh, "elu": torch.nn.ELU}[policy.activation]
    name = cfg.classes["algo"]
    if name == "ppo":
        return "PPO", ppo_kwargs(cfg, activation)
    gradient_steps = round(algo.updates_per_step * algo.num_steps * cfg.env.num_envs)
    common = dict(
        buffer_size=cfg.buffer.capacity,
        learning_starts=algo.learning_starts,
        batch_size=algo.batch_size,
        tau=algo.tau,
        gamma=algo.gamma,
        train_freq=algo.num_steps,
        gradient_steps=gradient_steps,
    )
    if name == "dqn":
        return "DQN", dict(
            common,
            learning_rate=algo.learning_rate,
            n_steps=algo.n_step,
            target_update_interval=algo.target_update_interval,
            exploration_fraction=algo.exploration_fraction,
            exploration_initial_eps=algo.exploration_initial_eps,
            exploration_final_eps=algo.exploration_final_eps,
            max_grad_norm=algo.max_grad_norm if algo.max_grad_norm > 0 else float("inf"),
            policy_kwargs=dict(net_arch=list(policy.hidden_sizes), activation_fn=activation),
        )
    if name == "td3":
        assert algo.policy_lr == algo.q_lr, "SB3's TD3 has one learning rate for the actor and the critics"
        assert list(policy.hidden_sizes) == list(algo.critic_hidden_sizes), "SB3's net_arch: actor and critics alike"
        return "TD3", dict(
            common,
            learning_rate=algo.policy_lr,
            policy_delay=algo.policy_delay,
            target_policy_noise=algo.target_policy_noise,
            target_noise_clip=algo.target_noise_clip,
            policy_kwargs=dict(net_arch=list(policy.hidden_sizes), activation_fn=activation),
        )
    if name == "sac":
        assert algo.policy_lr == algo.q_lr, "SB3's SAC has one learning rate for the actor, critics and entropy"
        assert algo.policy_frequency == 1, "SB3's SAC updates the actor at every gradient step"
        nets = dict(pi=list(policy.hidden_sizes), qf=list(algo.critic_hidden_sizes))
        assert policy.activation == algo.critic_activation, "SB3's activation_fn: actor and critics alike"
        return "SAC", dict(
            common,
            learning_rate=algo.policy_lr,
            # ent_coef "auto_<start>": learned from that start value toward target entropy -dim(A), as autotune.
            ent_coef=f"auto_{algo.alpha}" if algo.autotune else algo.alpha,
            target_update_interval=algo.target_network_frequency,
            policy_kwargs=dict(net_arch=nets, activation_fn=activation),
        )
    raise SystemExit(f"learning.py --sb3: algo.class {name!r} has no SB3 translation here (dqn, ppo, sac, td3 do)")


def ppo_kwargs(cfg, activation) -> dict:
    """SB3 PPO's keyword arguments, and under "normalize" VecNormalize's (None: no VecNormalize), as RL Zoo's
    `normalize: true` wraps the env: norm_obs from policy.normalize_obs, norm_reward from env.normalize_reward
    (its running return discounted by env.normalize_reward_gamma; it restarts after every episode end, as ours with
    env.normalize_reward_reset=done), clip_reward env.clip_reward, clip_obs 10."""
    algo, policy, env = cfg.algo, cfg.policy, cfg.env
    untranslated = {
        "policy.class": cfg.classes["policy"] != "actor_critic",
        "policy.encoder": policy.encoder == "cnn",
        "algo.vtrace": algo.vtrace,
        "env.clip_reward without env.normalize_reward": env.clip_reward > 0 and not env.normalize_reward,
        "env.groups": bool(env.groups),
    }
    refused = [key for key, bad in untranslated.items() if bad]
    if refused:
        raise SystemExit(f"learning.py --sb3: PPO with {', '.join(refused)} has no SB3 translation here")
    batch = algo.num_steps * env.num_envs
    if batch % algo.num_minibatches:
        raise SystemExit(f"learning.py --sb3: algo.num_minibatches must divide num_steps x num_envs = {batch}")

    def linear(start):  # ours anneals linearly to 0 over the run, as SB3's progress_remaining does
        return lambda progress_remaining: progress_remaining * start

    clip_range = linear(algo.clip_coef) if algo.anneal_clip else algo.clip_coef
    normalize = None
    if policy.normalize_obs or env.normalize_reward:
        normalize = dict(
            norm_obs=policy.normalize_obs,
            norm_reward=env.normalize_reward,
            gamma=env.normalize_reward_gamma,
            clip_obs=10.0,
            clip_reward=env.clip_reward if env.clip_reward > 0 else np.inf,
        )
    return dict(
        normalize=normalize,
        n_steps=algo.num_steps,
        batch_size=batch // algo.num_minibatches,
        n_epochs=algo.update_epochs,
        learning_rate=linear(algo.learning_rate) if algo.anneal_lr else algo.learning_rate,
        gamma=algo.gamma,
        gae_lambda=algo.gae_lambda,
        clip_range=clip_range,
        clip_range_vf=clip_range if algo.clip_value_loss else None,  # ours: the same clip_coef, annealed alike
        ent_coef=algo.ent_coef,
        vf_coef=algo.vf_coef,
        max_grad_norm=algo.max_grad_norm,
        normalize_advantage=algo.normalize_advantages,
        target_kl=algo.target_kl,
        policy_kwargs=dict(
            net_arch=dict(pi=list(policy.hidden_sizes), vf=list(policy.hidden_sizes)),
            activation_fn=activation,
            log_std_init=policy.log_std_init,
            ortho_init=policy.ortho_init,
        ),
    )


def sb3_model(cfg, seed: int):
    """(model, its VecEnv): SB3's DQN, PPO, SAC or TD3 on this config's env (cfg.env.num_envs of them, under
    VecNormalize where the config normalizes) with its hyperparameters (sb3_kwargs), this seed, on the CPU with one
    torch thread; not yet learning."""
    from stable_baselines3 import DQN, PPO, SAC, TD3
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.noise import NormalActionNoise
    from stable_baselines3.common.vec_env import VecNormalize

    name, kwargs = sb3_kwargs(cfg)
    normalize = kwargs.pop("normalize", None)
    torch.set_num_threads(1)
    atari = sb3_atari(cfg)
    env = atari(cfg.env.num_envs, seed) if atari else make_vec_env(cfg.env.id, n_envs=cfg.env.num_envs, seed=seed)
    if normalize is not None:
        env = VecNormalize(env, **normalize)
    if name == "TD3":
        # policy.exploration_noise: the std of Gaussian noise on actions scaled to [-1, 1], as SB3's action noise.
        dims = env.action_space.shape[0]
        kwargs["action_noise"] = NormalActionNoise(np.zeros(dims), np.full(dims, cfg.policy.exploration_noise))
    policy = "CnnPolicy" if atari else "MlpPolicy"
    model = {"DQN": DQN, "PPO": PPO, "SAC": SAC, "TD3": TD3}[name](policy, env, seed=seed, device="cpu", **kwargs)
    return model, env


# EnvPool's Atari kwargs and what SB3's AtariWrapper (or the ALE env under it) calls them.
ATARI_WRAPPER_KEYS = {
    "noop_max": "noop_max",
    "frame_skip": "frame_skip",
    "img_height": "screen_size",
    "episodic_life": "terminal_on_life_loss",
    "reward_clip": "clip_reward",
}
# EnvPool's Atari kwargs that SB3's pipeline has fixed: the value it has there, which the config must keep.
ATARI_FIXED = {
    "img_width": 84,
    "stack_num": 4,  # VecFrameStack(4) below: other stacks are refused rather than silently differing
    "gray_scale": True,
    "use_fire_reset": True,  # AtariWrapper fires after every reset of a game with FIRE (Breakout has it)
    "full_action_space": False,
    "zero_discount_on_life_loss": False,
    "num_threads": None,  # EnvPool's own threading: no meaning for SB3, any value accepted
    "use_inter_area_resize": True,  # AtariWrapper's WarpFrame resizes with cv2.INTER_AREA
}


def sb3_atari(cfg):
    """None unless the config plays an Atari game through EnvPool (env.backend: envpool, an ALE id such as
    Breakout-v5). Then a function (n_envs, seed) -> SB3's VecEnv of the same game with the same preprocessing:
    ALE's <Game>NoFrameskip-v4 under SB3's AtariWrapper (make_atari_env) and VecFrameStack, each EnvPool setting
    (its defaults, then env.kwargs) translated key by key; a setting SB3 cannot express is refused."""
    if cfg.env.backend != "envpool" or cfg.classes["policy"] != "q_network" or cfg.policy.cnn != "nature":
        return None
    import ale_py
    import envpool
    import gymnasium as gym
    from stable_baselines3.common.env_util import make_atari_env
    from stable_baselines3.common.vec_env import VecFrameStack

    gym.register_envs(ale_py)
    game = cfg.env.id.removesuffix("-v5")
    ale_id = f"{game}NoFrameskip-v4"
    if ale_id not in gym.registry:
        raise SystemExit(f"learning.py --sb3: env.id {cfg.env.id!r} is not an ALE game ({ale_id} is not registered)")
    settings = {**envpool.make_spec(cfg.env.id).config._asdict(), **cfg.env.kwargs}
    refused = [
        f"{key}={settings[key]}" for key, value in ATARI_FIXED.items() if value is not None and settings[key] != value
    ]
    if refused:
        raise SystemExit(f"learning.py --sb3: env.kwargs {', '.join(refused)} have no SB3 AtariWrapper translation")
    if cfg.policy.cnn_init != "default":  # auto means orthogonal for the nature preset
        raise SystemExit(
            f"learning.py --sb3: policy.cnn_init={cfg.policy.cnn_init} has no SB3 translation: SB3's DQN CnnPolicy "
            "keeps torch's default init (policy.cnn_init=default)"
        )
    wrapper = {theirs: settings[ours] for ours, theirs in ATARI_WRAPPER_KEYS.items()}
    ale = dict(
        repeat_action_probability=settings["repeat_action_probability"],
        # EnvPool's max_episode_steps counts agent steps, ALE's limit frames
        max_num_frames_per_episode=settings["max_episode_steps"] * settings["frame_skip"],
    )

    def make(n_envs: int, seed: int):
        envs = make_atari_env(ale_id, n_envs=n_envs, seed=seed, wrapper_kwargs=wrapper, env_kwargs=ale)
        return VecFrameStack(envs, n_stack=settings["stack_num"])

    return make


def sb3_seed(config: Path, overrides: list[str], seed: int, checkpoint: Path | None = None) -> dict:
    """SB3 on this config's env, hyperparameters, seed and budget, in this process: its final deterministic
    evaluation (10 episodes) and the mean of its last 20 training episodes. With a checkpoint folder the run saves
    itself there and resumes from it (sb3_learn)."""
    import gymnasium as gym
    from stable_baselines3.common.evaluation import evaluate_policy
    from stable_baselines3.common.vec_env import DummyVecEnv, VecNormalize

    cfg = load_config(str(config), overrides)
    model, env = sb3_model(cfg, seed)
    model, wall, resumed = sb3_learn(model, env, cfg.train.total_steps, checkpoint)
    returns = [e["r"] for e in list(model.ep_info_buffer)[-WINDOW:]]
    atari = sb3_atari(cfg)
    # Atari: the training preprocessing; its Monitor (under AtariWrapper) counts whole games, as ours does
    eval_env = atari(1, 10_000 + seed) if atari else gym.make(cfg.env.id)
    if not atari:
        eval_env.reset(seed=10_000 + seed)
    if isinstance(env, VecNormalize):  # as RL Zoo evaluates: the training statistics and settings, frozen; raw rewards
        frozen = dict(norm_obs=env.norm_obs, clip_obs=env.clip_obs, gamma=env.gamma, epsilon=env.epsilon)
        eval_env = VecNormalize(DummyVecEnv([lambda: eval_env]), training=False, norm_reward=False, **frozen)
        eval_env.obs_rms = copy.deepcopy(env.obs_rms)
    mean, _ = evaluate_policy(model, eval_env, n_eval_episodes=cfg.eval.episodes or 10, deterministic=True)
    return {
        "eval": float(mean),
        "train": sum(returns) / len(returns) if returns else None,
        "env_steps": model.num_timesteps,
        "wall_s": wall,
        **({"resumed": resumed} if resumed else {}),
    }


def sb3_learn(model, env, total_steps: int, checkpoint: Path | None):
    """model.learn() to total_steps, saved every SB3_SAVE_EVERY env steps into checkpoint/ (the model with its
    optimizers, the replay buffer of DQN, SAC and TD3, VecNormalize's statistics for PPO with normalization, the
    wall clock so far) and resumed from there if it holds a save. SB3 restores networks, optimizers, replay and step
    count but not its random streams, so a resumed baseline is an equal run in distribution, not the same run (its
    results file says how often it resumed). Returns (model, wall seconds over every session, times resumed)."""
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.vec_env import VecNormalize

    replay = hasattr(model, "replay_buffer")  # off-policy; PPO's rollout buffer is refilled after a resume
    stats = isinstance(env, VecNormalize)  # PPO with normalization: VecNormalize's statistics, outside the model
    clock = {"wall_s": 0.0, "resumed": 0}
    if checkpoint is not None and (checkpoint / "clock.json").exists():
        clock = json.loads((checkpoint / "clock.json").read_text())
        clock["resumed"] += 1
        model = type(model).load(checkpoint / "model.zip", env=env, device="cpu")
        if replay:
            model.load_replay_buffer(checkpoint / "replay.pkl")
        if stats:
            saved = VecNormalize.load(str(checkpoint / "vecnormalize.pkl"), env.venv)
            env.obs_rms, env.ret_rms = saved.obs_rms, saved.ret_rms  # its running return restarts with the env
        print(f"sb3: resumed at {model.num_timesteps} env steps ({checkpoint})", flush=True)
    start = time.perf_counter()

    class Saver(BaseCallback):
        def __init__(self):
            super().__init__()
            self.saved_at = model.num_timesteps

        def _on_step(self) -> bool:
            if checkpoint is not None and self.num_timesteps - self.saved_at >= SB3_SAVE_EVERY:
                self.saved_at = self.num_timesteps
                checkpoint.mkdir(parents=True, exist_ok=True)
                # The clock last: a save is whole once clock.json names it (each file replaced in one rename).
                self.model.save(checkpoint / "model.tmp.zip")
                if replay:
                    self.model.save_replay_buffer(checkpoint / "replay.tmp.pkl")
                if stats:
                    env.save(str(checkpoint / "vecnormalize.tmp.pkl"))
                os.replace(checkpoint / "model.tmp.zip", checkpoint / "model.zip")
                for name, kept in (("replay", replay), ("vecnormalize", stats)):
                    if kept:
                        os.replace(checkpoint / f"{name}.tmp.pkl", checkpoint / f"{name}.pkl")
                now = {**clock, "wall_s": clock["wall_s"] + time.perf_counter() - start}
                (checkpoint / "clock.tmp.json").write_text(json.dumps(now))
                os.replace(checkpoint / "clock.tmp.json", checkpoint / "clock.json")
            return True

    model.learn(total_timesteps=total_steps - model.num_timesteps, reset_num_timesteps=False, callback=Saver())
    return model, clock["wall_s"] + time.perf_counter() - start, clock["resumed"]


def run_sb3_seed(config: Path, seed: int, where: Path, overrides: list[str], timeout_s: float, results: Path) -> int:
    """SB3's run of this seed in a process of its own (so --parallel applies), unless its results file exists."""
    saved = results_file(results, where, seed, "sb3")
    if saved.exists():
        print(f"sb3 seed {seed}: finished before, skipped ({saved})", flush=True)
        return 0
    cmd = [sys.executable, __file__, "--config", str(config), "--sb3-seed", str(seed), "--results", str(saved)]
    cmd += ["--sb3-checkpoint", str(where / f"sb3_seed{seed}")]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    print(f"sb3 seed {seed}: starting", flush=True)
    with open(where / f"sb3_seed{seed}.log", "a") as log:
        try:
            run = subprocess.run(
                [*cmd, *overrides], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s
            )
        except subprocess.TimeoutExpired:
            print(f"sb3 seed {seed}: still running after --timeout-h, killed", flush=True)
            return 124
    print(f"sb3 seed {seed}: exit {run.returncode}", flush=True)
    return run.returncode


def saved_result(results: Path, where: Path, seed: int, who: str = "") -> dict | None:
    """A finished seed's numbers: its results file, else (spmd_rl) its run directory; None while unfinished."""
    saved = results_file(results, where, seed, who)
    if saved.exists():
        return json.loads(saved.read_text())
    return None if who else seed_result(where / f"seed{seed}")


def seed_result(run_dir: Path) -> dict | None:
    """A finished seed's final evaluation (None unless the last iteration was evaluated) and the mean of its last
    20 training episodes; None while the seed is unfinished."""
    if not (run_dir / FINISHED).exists():
        return None
    records = [json.loads(line) for line in (run_dir / METRICS_FILE).read_text().splitlines()]
    evaluated = [r for r in records if r.get("eval_return_mean") is not None]
    last = records[-1]
    final_eval = evaluated[-1] if evaluated and evaluated[-1]["iteration"] == last["iteration"] else None
    return {
        "eval": final_eval["eval_return_mean"] if final_eval else None,
        "train": last["episode_return_mean"],
        "env_steps": last["env_steps"],
        "wall_s": last["wall_s"],
    }


def mean_std(values: list[float]) -> str:
    if not values:
        return "-"
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.0f} +- {std:.0f}"


def seeds_row(label: str, done: dict[int, dict], seeds: list[int], versus: str = "") -> list[str]:
    evals = [r["eval"] for r in done.values() if r["eval"] is not None]
    trains = [r["train"] for r in done.values() if r["train"] is not None]
    return [
        label,
        f"{len(done)}/{len(seeds)}",
        mean_std(evals),
        " ".join("-" if r["eval"] is None else f"{r['eval']:.0f}" for r in done.values()) or "-",
        mean_std(trains),
        f"{statistics.mean(r['env_steps'] for r in done.values()):.0f}" if done else "-",
        f"{statistics.mean(r['wall_s'] for r in done.values()) / 60:.1f}" if done else "-",
        versus,
    ]


def seeds_table(config: Path, where: Path, seeds: list[int], results: Path, sb3: bool = False) -> str:
    """Ours (mean +- std over the finished seeds) above SB3's (--sb3) and the published numbers, in one table."""
    done = {s: r for s in seeds if (r := saved_result(results, where, s)) is not None}
    evals = [r["eval"] for r in done.values() if r["eval"] is not None]
    ours = statistics.mean(evals) if evals else None
    rows = [seeds_row(f"spmd_rl {where.name}", done, seeds)]
    if sb3:
        theirs = {s: r for s in seeds if (r := saved_result(results, where, s, "sb3")) is not None}
        sb3_evals = [r["eval"] for r in theirs.values() if r["eval"] is not None]
        mean = statistics.mean(sb3_evals) if sb3_evals else None
        versus = f"{ours - mean:+.0f}" if ours is not None and mean is not None else "-"
        rows.append(seeds_row("SB3, same settings, seeds and budget", theirs, seeds, versus))
    for source, mean, std in PUBLISHED.get(config.stem, []):
        ratio = f" ({ours / mean:.2f}x)" if ours is not None and mean > 0 else ""  # no ratio of negative returns
        versus = f"{ours - mean:+.0f}{ratio}" if ours is not None and mean else "-"
        rows.append([source, "1 agent", f"{mean:.0f} +- {std:.0f}", "", "", "", "", versus])
    headers = [
        "run",
        "seeds done",
        "final eval (deterministic), mean +- std over seeds",
        "per seed",
        "last 20 training episodes",
        "env steps",
        "wall min/run",
        "spmd_rl vs this",
    ]
    return table(headers, rows)


def run_seeds(args, overrides: list[str]) -> int:
    config = Path(args.config)
    if not config.is_file():
        print(f"learning.py: --config {config}: no such file", file=sys.stderr)
        return 2
    where = bench_dir(Path(args.out), config, overrides)
    where.mkdir(parents=True, exist_ok=True)
    seeds = seed_list(args)
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    header = f"machine: {machine()}; load average at start {load}\n{versions_line()}"
    print(header, flush=True)
    results = Path(args.results)
    codes = {}
    if not args.report_only:
        timeout_s = args.timeout_h * 3600
        with ThreadPoolExecutor(max_workers=args.parallel) as pool:
            # Seed by seed, SB3's run right after ours: two workers run both of one seed side by side (the same
            # load), and a benchmark stopped half way leaves pairs, not only our seeds.
            futures = {}
            for s in seeds:
                futures[s] = pool.submit(run_seed, config, s, where, overrides, timeout_s, results)
                if args.sb3:
                    futures[-s] = pool.submit(run_sb3_seed, config, s, where, overrides, timeout_s, results)
            codes = {s: future.result() for s, future in futures.items()}
    result = seeds_table(config, where, seeds, results, args.sb3)
    print(result)
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    chosen = f"--seed-list {args.seed_list}" if args.seed_list else f"--seeds {args.seeds}"
    command = " ".join(["--config", str(config), chosen, *overrides])
    (where / "results.md").write_text(f"learning.py {command}\n\n{header}; at the end {load}\n\n{result}\n")
    failed = [("sb3 " if s < 0 else "") + str(abs(s)) for s, code in codes.items() if code != 0]
    if failed:
        print(f"seeds {failed} did not finish: rerun the same command to resume them", file=sys.stderr)
        return 1
    return 0


def seed_list(args) -> list[int]:
    """--seed-list (e.g. one seed left over from an earlier run) or 1..--seeds."""
    if not args.seed_list:
        return list(range(1, args.seeds + 1))
    try:
        return [int(s) for s in args.seed_list.split(",")]
    except ValueError:
        print(f"learning.py: --seed-list {args.seed_list}: comma-separated integers expected", file=sys.stderr)
        sys.exit(2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--seed-list", default="", help="these seeds (comma-separated) instead of 1..--seeds")
    parser.add_argument("--layouts", default="one,colocated2,split8")
    parser.add_argument("--no-sb3", action="store_true")
    parser.add_argument("--config", help="the seed runner: this config over seeds 1..--seeds (see above)")
    parser.add_argument("--out", default=str(ROOT / "runs" / "bench"), help="the seed runner's folder of runs")
    parser.add_argument(
        "--parallel", type=int, default=2, help="the seed runner's runs at a time", choices=range(1, 65)
    )
    parser.add_argument("--timeout-h", type=float, default=24.0, help="the seed runner's bound on one run, hours")
    parser.add_argument("--report-only", action="store_true", help="the seed runner: print the table, run nothing")
    parser.add_argument(
        "--results",
        default=str(ROOT / "benchmarks" / "results"),
        help="the seed runner's folder of per-seed results files (kept in git)",
    )
    parser.add_argument("--sb3", action="store_true", help="the seed runner: SB3 DQN, PPO, SAC or TD3 beside each seed")
    parser.add_argument("--sb3-seed", type=int, help=argparse.SUPPRESS)  # one SB3 seed, into the file --results
    parser.add_argument("--sb3-checkpoint", help=argparse.SUPPRESS)  # the folder it saves itself in and resumes from
    args, overrides = parser.parse_known_args()
    seed_list(args)  # a bad --seed-list is refused before anything runs
    if args.sb3_seed is not None:
        checkpoint = Path(args.sb3_checkpoint) if args.sb3_checkpoint else None
        result = sb3_seed(Path(args.config), overrides, args.sb3_seed, checkpoint)
        print(json.dumps(result), flush=True)
        write_result(Path(args.results), {"seed": args.sb3_seed, **result})
        sys.exit(0)
    if args.config:
        sys.exit(run_seeds(args, overrides))
    if overrides:
        parser.error(f"unrecognized arguments: {' '.join(overrides)} (config overrides need --config)")
    print(f"machine: {machine()}")
    print(versions_line())
    runs: dict[str, list[dict]] = {}
    for seed in seed_list(args):
        if not args.no_sb3:
            runs.setdefault("sb3 (same settings)", []).append(sb3_solve(seed))
        for layout in args.layouts.split(","):
            runs.setdefault(f"spmd_rl {layout}", []).append(spmd_solve(layout, seed))
        print(f"seed {seed} done", flush=True)

    baseline = runs.get("sb3 (same settings)")
    baseline_wall = statistics.median([r["wall_s"] for r in baseline if r["wall_s"]]) if baseline else None
    rows = []
    for name, results in runs.items():
        steps = [r["steps"] for r in results]
        walls = [r["wall_s"] for r in results if r["wall_s"] is not None]
        solved = [s for s in steps if s is not None]
        median_wall = statistics.median(walls) if walls else None
        rows.append(
            [
                name,
                f"{len(solved)}/{len(results)}",
                " ".join(fmt(s) for s in steps),
                fmt(statistics.median(solved) if solved else None, 0),
                fmt(median_wall),
                fmt(median_wall / baseline_wall, 2) if median_wall and baseline_wall else "-",
                " ".join(fmt(r["final"], 0) for r in results),
            ]
        )
    print(
        table(
            [
                "run",
                "solved",
                "env steps to solve (per seed)",
                "median steps",
                "median wall s",
                "wall vs sb3",
                "final return (per seed)",
            ],
            rows,
        )
    )


if __name__ == "__main__":
    main()
