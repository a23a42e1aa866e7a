"""PPO on Atari Breakout (EnvPool, Nature CNN, configs/ppo_atari.yaml) against the same envs alone, and against
Stable-Baselines3's PPO CnnPolicy with the same hyperparameters on the same EnvPool envs, in one run (one torch
thread everywhere; the runs alternate when repeated, so a change in the machine's load hits every side alike).

    python benchmarks/pixels.py [--iterations 4] [--repeats 1] [--no-sb3]
    python benchmarks/pixels.py --learn-steps 200000   # learning: spmd_rl and SB3 on the same budget, side by side

Rows:
  - raw env: EnvPool's Breakout-v5, 8 envs, the config's env.kwargs, random actions drawn up front;
  - env + act: the same envs stepped with the Nature CNN's act() on every observation batch (no learning): what
    acting costs on top of the env;
  - spmd_rl PPO: `python -m spmd_rl.main --config configs/ppo_atari.yaml`, steady state (from the end of the first
    iteration to the end of the last, leaving out start-up), with the phase times it logs;
  - SB3 PPO: CnnPolicy (NatureCNN, linear heads, images scaled by 1/255) on an adapter of the same EnvPool envs,
    measured over the same iterations (from the start of its second rollout).
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, machine, run_spmd, table  # noqa: E402

CONFIG = ROOT / "configs" / "ppo_atari.yaml"
ENV_ID, NUM_ENVS, NUM_STEPS = "Breakout-v5", 8, 128
ENV_KWARGS = {"episodic_life": True, "reward_clip": True}


def make_envs(seed: int = 1):
    import envpool

    return envpool.make(ENV_ID, env_type="gymnasium", num_envs=NUM_ENVS, seed=seed, **ENV_KWARGS)


def raw_env_sps(steps: int) -> float:
    envs = make_envs()
    envs.reset()
    actions = np.random.default_rng(0).integers(0, envs.single_action_space.n, (steps, NUM_ENVS))
    start = time.perf_counter()
    for action in actions:
        envs.step(action)
    elapsed = time.perf_counter() - start
    envs.close()
    return steps * NUM_ENVS / elapsed


def env_and_act_sps(steps: int) -> float:
    from spmd_rl.modules.actor_critic import ActorCritic
    from spmd_rl.modules.configs import ActorCriticConfig

    torch.set_num_threads(1)
    envs = make_envs()
    policy = ActorCritic(
        envs.single_observation_space, envs.single_action_space, ActorCriticConfig(cnn="nature", hidden_sizes=[])
    )
    obs, _ = envs.reset()
    start = time.perf_counter()
    with torch.no_grad():
        for _ in range(steps):
            action = policy.act(torch.from_numpy(obs))["action"].numpy()
            obs, *_ = envs.step(action)
    elapsed = time.perf_counter() - start
    envs.close()
    return steps * NUM_ENVS / elapsed


def spmd_ppo(iterations: int) -> dict:
    records = run_spmd([f"train.total_steps={iterations * NUM_STEPS * NUM_ENVS}"], config=str(CONFIG))
    first, last = records[0], records[-1]
    steady = records[1:]
    return {
        "sps": (last["env_steps"] - first["env_steps"]) / (last["wall_s"] - first["wall_s"]),
        "phases": {key: sum(r[key] for r in steady) for key in ("time_env_s", "time_inference_s", "time_learn_s")},
        "wall": last["wall_s"] - first["wall_s"],
    }


def envpool_vec_env(envs):
    """SB3's VecEnv over EnvPool's envs. SB3 expects an ended env's next observation in the same step (with the
    final one in its info); EnvPool resets an env on its step after the end, so the ended envs take that reset step
    here at once. (Not envs.reset(env_id): under episodic_life that restarts the game at every lost life, where the
    reset step continues it, as spmd_rl's env runner does; the adapter used reset() until 2026-12-01.) `games`
    collects finished games' scores, counted as spmd_rl's EnvPool backend counts them (the game's own reward,
    info["reward"], summed until info["terminated"], the game's end, or a truncation)."""
    from stable_baselines3.common.vec_env import VecEnv

    class EnvPoolVecEnv(VecEnv):
        def __init__(self):
            self.envs = envs
            self.scores = np.zeros(envs.num_envs)
            self.games: list[float] = []
            super().__init__(envs.num_envs, envs.single_observation_space, envs.single_action_space)

        def reset(self):
            return self.envs.reset()[0]

        def step_async(self, actions):
            self.actions = actions

        def step_wait(self):
            obs, reward, terminated, truncated, info = self.envs.step(self.actions)
            self.scores += info["reward"]
            for i in np.flatnonzero(info["terminated"] | truncated):
                self.games.append(float(self.scores[i]))
                self.scores[i] = 0.0
            done = terminated | truncated
            infos = [{} for _ in range(self.num_envs)]
            ended = np.flatnonzero(done)
            if ended.size:
                for i in ended:
                    infos[i]["terminal_observation"] = obs[i]
                    infos[i]["TimeLimit.truncated"] = bool(truncated[i] and not terminated[i])
                obs = obs.copy()
                reset_obs, *_, reset_info = self.envs.step(
                    np.zeros(ended.size, np.int64), env_id=ended.astype(np.int32)
                )
                obs[reset_info["env_id"]] = reset_obs
            return obs, reward, done, infos

        def close(self):
            self.envs.close()

        def get_attr(self, attr_name, indices=None):
            return [None] * self.num_envs

        def set_attr(self, attr_name, value, indices=None):
            pass

        def env_method(self, method_name, *args, indices=None, **kwargs):
            return [None] * self.num_envs

        def env_is_wrapped(self, wrapper_class, indices=None):
            return [False] * self.num_envs

    return EnvPoolVecEnv()


def sb3_model(vec_env):
    """SB3's PPO CnnPolicy with configs/ppo_atari.yaml's hyperparameters, one torch thread."""
    from stable_baselines3 import PPO

    torch.set_num_threads(1)
    return PPO(
        "CnnPolicy",
        vec_env,
        n_steps=NUM_STEPS,
        batch_size=NUM_STEPS * NUM_ENVS // 4,
        n_epochs=4,
        learning_rate=lambda remaining: 2.5e-4 * remaining,
        clip_range=lambda remaining: 0.1 * remaining,
        ent_coef=0.01,
        vf_coef=0.5,
        gamma=0.99,
        gae_lambda=0.95,
        max_grad_norm=0.5,
        seed=1,
        device="cpu",
    )


def sb3_ppo(iterations: int) -> float:
    from stable_baselines3.common.callbacks import BaseCallback

    class RolloutClock(BaseCallback):
        def __init__(self):
            super().__init__()
            self.starts: list[tuple[float, int]] = []

        def _on_rollout_start(self) -> None:
            self.starts.append((time.perf_counter(), self.num_timesteps))

        def _on_step(self) -> bool:
            return True

    model = sb3_model(envpool_vec_env(make_envs()))
    clock = RolloutClock()
    model.learn(total_timesteps=iterations * NUM_STEPS * NUM_ENVS, callback=clock)
    end = time.perf_counter()
    start, start_steps = clock.starts[1]
    return (model.num_timesteps - start_steps) / (end - start)


def learning(steps: int) -> None:
    """Both learners on the same budget of env steps (their learning rates anneal over it), side by side: spmd_rl
    in its own process, SB3 in this one; the score is the mean of the last 20 finished games."""
    result: dict = {}
    spmd = threading.Thread(
        target=lambda: result.update(records=run_spmd([f"train.total_steps={steps}"], config=str(CONFIG), timeout=7200))
    )
    started = time.perf_counter()
    spmd.start()
    vec_env = envpool_vec_env(make_envs())
    sb3_model(vec_env).learn(total_timesteps=steps)
    sb3_wall = time.perf_counter() - started
    spmd.join()
    last = result["records"][-1]
    rows = [
        [
            "spmd_rl PPO (configs/ppo_atari.yaml)",
            last["env_steps"],
            last["episodes"],
            f"{last['episode_return_mean']:.2f}",
            f"{last['wall_s']:.0f}",
        ],
        ["SB3 PPO CnnPolicy", steps, len(vec_env.games), f"{np.mean(vec_env.games[-20:]):.2f}", f"{sb3_wall:.0f}"],
    ]
    print(table(["learner (Breakout-v5, EnvPool)", "env steps", "games", "score, last 20 games", "wall s"], rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=4, help="PPO iterations of 1024 env steps per run")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--no-sb3", action="store_true")
    parser.add_argument(
        "--learn-steps", type=int, help="instead: learn for this many env steps, spmd_rl and SB3 side by side"
    )
    args = parser.parse_args()
    print(machine(), f"load average at start {os.getloadavg()}")
    if args.learn_steps:
        learning(args.learn_steps)
        print(f"load average at end {os.getloadavg()}")
        return
    results: dict[str, list[float]] = {"raw": [], "act": [], "spmd": [], "sb3": []}
    phases = []
    for _ in range(args.repeats):
        results["raw"].append(raw_env_sps(500))
        results["act"].append(env_and_act_sps(200))
        spmd = spmd_ppo(args.iterations)
        results["spmd"].append(spmd["sps"])
        phases.append(spmd)
        if not args.no_sb3:
            results["sb3"].append(sb3_ppo(args.iterations))
    best = {key: max(values) for key, values in results.items() if values}
    rows = [
        ["raw env (8 envs, random actions)", f"{best['raw']:.0f}", "1.00"],
        ["env + Nature CNN act (no learning)", f"{best['act']:.0f}", f"{best['act'] / best['raw']:.2f}"],
        ["spmd_rl PPO, one process", f"{best['spmd']:.0f}", f"{best['spmd'] / best['raw']:.2f}"],
    ]
    if "sb3" in best:
        rows.append(["SB3 PPO CnnPolicy, same envs", f"{best['sb3']:.0f}", f"{best['sb3'] / best['raw']:.2f}"])
    print(table(["run (Breakout-v5, EnvPool)", "env steps/s (best)", "vs raw env"], rows))
    if "sb3" in best:
        print(f"spmd_rl / SB3: {best['spmd'] / best['sb3']:.2f}x")
    shares = phases[0]["phases"]
    print(
        "spmd_rl steady iterations, seconds: "
        + ", ".join(f"{key[5:-2]} {value:.1f}" for key, value in shares.items())
        + f" of {phases[0]['wall']:.1f} wall"
    )
    print(f"load average at end {os.getloadavg()}; all runs: {results}")


if __name__ == "__main__":
    main()
