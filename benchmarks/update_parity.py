"""Are spmd_rl's TD3 and DQN updates Stable-Baselines3's? Both sides start from the same weights, take the same
replay batches and the same random draws, and are compared parameter by parameter after every update, against a
yardstick measured in the same run: how far a copy of our own update drifts when it is kept one ulp off.

    python benchmarks/update_parity.py [--config configs/mujoco/td3_halfcheetah.yaml] [--updates 300] [--seed 1]
        [section.key=value ...]

Without --config: configs/mujoco/td3_halfcheetah.yaml, configs/dqn_cartpole.yaml and configs/dqn_atari.yaml in
turn, one table. The overrides apply to our side only, so that a deliberate difference shows as DIFFERENT (e.g.
algo.target_noise_clip=0.4, algo.policy_delay=3, algo.tau=0.0051, algo.double=true, algo.max_grad_norm=1,
policy.cnn_init=orthogonal). Exit 1 if any config is DIFFERENT, in its init or in its updates.

Per config:
1. SB3's model from learning.py's sb3_model (the config's hyperparameters key by key); ours as a run builds it
   (build_policy, then the algorithm on a one-process Context.local, no process group), twice.
2. Init: each Linear/Conv2d of SB3's online networks (actor then critics, or the Q-network) beside ours, in order:
   DIFFERENT where a weight std ratio passes 1.25x or biases are zero on one side only.
3. SB3's weights, its targets' too, copied into both of ours. The second copy, the yardstick, then moves every
   value one ulp up, and after each of its updates one ulp up or down at random: rounding-sized differences in
   every update, as two implementations of one update have (SB3's Polyak average (1 - tau) * target + tau * online
   and our lerp round differently at every target update; with a yardstick only started one ulp off, a clean TD3
   run on seed 2 gave an RMS ratio of 3.1 from that alone).
4. Transitions from the real env under uniform random actions (SB3's VecEnv: HalfCheetah-v5, CartPole-v1, or
   BreakoutNoFrameskip-v4 under AtariWrapper + VecFrameStack(4), uint8 4x84x84), then one batch per update drawn
   by a seeded generator. SB3 runs its own train(gradient_steps=1) with only replay_buffer.sample replaced by that
   batch (actions scaled to [-1, 1] as its buffer keeps them); ours runs update() on the same rows (actions in env
   units; DQN's discount: gamma, 0 where the episode terminated, as our 1-step transitions carry it), with
   denormals flushed to zero as our Trainer runs it (SB3 unflushed).
5. Random draws: TD3's target smoothing noise is the first draw of an update on both sides (SB3 normal_(0, s) on a
   copy of the actions, ours randn_like(actions) * s: the same numbers from the same seed), so torch.manual_seed(k)
   precedes update k on every side. DQN's update draws nothing.
6. Schedule: one env-step clock, SB3's: train_freq env steps, then gradient_steps updates, from the segment after
   learning_starts. Before a segment's updates SB3 counts its env steps by its own _on_step (DQN: the target copy
   every target_update_interval steps); ours updates its target as its learn() would (where the segment crossed a
   multiple of the interval). TD3's delayed actor step counts updates on both sides (2, 4, ...).

Report: the largest |parameter difference| over all networks (online and targets), SB3 vs ours and ours vs the
yardstick, after update 1 and at its largest, and their ratio (largest / largest: both sides reach the chaotic
drift of any two runs within a few hundred updates, so it is shown, not judged). The verdict: per network and
update, the root-mean-square difference SB3 vs ours over ours vs the yardstick; SAME while its largest is <= 2.
Losses of the three sides at updates 1, 10, 100 and the last. Left out, unlike a run: replay sampling, exploration,
the env loop, learning starts (the clock replaces them) and our n-step transitions (the discount is made here).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))  # common.py and learning.py beside this file
from common import ROOT, machine, table, versions_line  # noqa: E402
from learning import sb3_model  # noqa: E402
from tensordict import TensorDict  # noqa: E402

from spmd_rl.api import Context  # noqa: E402
from spmd_rl.config.loading import load_config  # noqa: E402
from spmd_rl.envs.vector import probe_env  # noqa: E402
from spmd_rl.roles.trainer import FlushDenormals  # noqa: E402
from spmd_rl.run.contract import load_classes  # noqa: E402
from spmd_rl.run.policies import build_policy  # noqa: E402

CONFIGS = ["configs/mujoco/td3_halfcheetah.yaml", "configs/dqn_cartpole.yaml", "configs/dqn_atari.yaml"]
TRANSITIONS = 3000  # collected per config; every batch is drawn from all of them
SMALL_BUFFER = ["buffer.capacity=1000"]  # neither side's replay is read: spare SB3's 5.6 GB Atari allocation
STD_TOLERANCE = 1.25  # init: a layer's weight std ratio counted as the same distribution
RATIO_TOLERANCE = 2.0  # updates: SB3's RMS difference over the yardstick's
LOSS_KEYS = {"td3": ("train/critic_loss", "qf_loss"), "dqn": ("train/loss", "loss")}
TD3_NETWORKS = ("actor", "critic", "actor_target", "critic_target")  # attribute names on both sides


def layers(module: nn.Module) -> list[nn.Module]:
    """The weight layers of a network, in registration order (SB3's and ours list them alike)."""
    return [m for m in module.modules() if isinstance(m, (nn.Linear, nn.Conv2d))]


def sb3_networks(model, algo: str) -> dict[str, list[nn.Module]]:
    if algo == "td3":
        return {name: layers(getattr(model, name)) for name in TD3_NETWORKS}
    return {"q_net": layers(model.q_net), "q_net_target": layers(model.q_net_target)}


def our_networks(ours, algo: str) -> dict[str, list[nn.Module]]:
    if algo == "td3":
        return {name: layers(getattr(ours, name)) for name in TD3_NETWORKS}
    return {"q_net": layers(ours.q_network), "q_net_target": layers(ours.target)}


def params(layer_list: list[nn.Module]) -> list[torch.Tensor]:
    return [t for m in layer_list for t in (m.weight, m.bias)]


def build_ours(cfg):
    """Our algorithm (holding the policy) as a run builds it, in this process: one trainer, no process group."""
    spec = probe_env(cfg.env)
    policy_cls, algorithm_cls, _, _ = load_classes(cfg)
    context = Context.local(
        spec.observation_space,
        spec.action_space,
        steps_per_iteration=cfg.algo.num_steps * cfg.env.num_envs,
        buffer=cfg.buffer,
    )
    return algorithm_cls(build_policy(cfg, spec, policy_cls), cfg.algo, context)


def init_check(theirs: list[nn.Module], ours: list[nn.Module]) -> tuple[bool, str]:
    """(same, what): per layer our weight std over SB3's, and whether the biases are zero on each side."""
    shapes = [tuple(m.weight.shape) for m in theirs], [tuple(m.weight.shape) for m in ours]
    if shapes[0] != shapes[1]:  # no weights to copy across either
        raise SystemExit(f"the layers differ: SB3 {shapes[0]}, ours {shapes[1]}")
    found, worst = [], 1.0
    for index, (a, b) in enumerate(zip(theirs, ours)):
        ratio = (b.weight.std() / a.weight.std()).item()
        worst = max(worst, ratio, 1 / ratio)
        zero = bool((a.bias == 0).all()), bool((b.bias == 0).all())
        if max(ratio, 1 / ratio) > STD_TOLERANCE or zero[0] != zero[1]:
            found.append(
                f"layer {index} {type(a).__name__} {tuple(a.weight.shape)}: weight std SB3 {a.weight.std():.4f}, "
                f"ours {b.weight.std():.4f} (ours/SB3 {ratio:.2f}x); zero biases SB3 {zero[0]}, ours {zero[1]}"
            )
    return not found, "; ".join(found) or f"largest weight std ratio {worst:.2f}x, zero biases alike"


@torch.no_grad()
def copy_weights(source: list[nn.Module], target: list[nn.Module]) -> None:
    for a, b in zip(source, target):
        b.weight.copy_(a.weight)
        b.bias.copy_(a.bias)


@torch.no_grad()
def nudge(tensors: list[torch.Tensor], generator: torch.Generator | None = None) -> None:
    """Every value one ulp up, or with a generator one ulp up or down at random."""
    for t in tensors:
        up = torch.rand(t.shape, generator=generator) < 0.5 if generator else torch.ones_like(t, dtype=torch.bool)
        t.copy_(torch.nextafter(t, torch.where(up, torch.inf, -torch.inf)))


def differences(a: list[torch.Tensor], b: list[torch.Tensor]) -> tuple[float, float]:
    """(largest |a - b|, root mean square of a - b) over these tensors."""
    diff = torch.cat([(x.detach() - y.detach()).flatten() for x, y in zip(a, b)])
    return diff.abs().max().item(), diff.square().mean().sqrt().item()


def collect(model, count: int, seed: int) -> dict[str, torch.Tensor]:
    """count transitions of SB3's VecEnv (one env) under uniform random actions: obs, action (env units), reward,
    next_obs (the final observation where an episode ended), terminated (not a time-limit truncation)."""
    env = model.env
    env.action_space.seed(seed)
    obs = env.reset()
    rows = {key: [] for key in ("obs", "action", "reward", "next_obs", "terminated")}
    for _ in range(count):
        action = np.array([env.action_space.sample()])
        new_obs, reward, done, infos = env.step(action)
        rows["obs"].append(obs[0])
        rows["action"].append(action[0])
        rows["reward"].append(reward[0])
        rows["next_obs"].append(infos[0]["terminal_observation"] if done[0] else new_obs[0])
        rows["terminated"].append(bool(done[0]) and not infos[0].get("TimeLimit.truncated", False))
        obs = new_obs
    data = {key: torch.as_tensor(np.stack(values)) for key, values in rows.items()}
    for key in ("obs", "next_obs"):  # MuJoCo's float64 observations: both sides compute in float32
        if data[key].is_floating_point():
            data[key] = data[key].float()
    data["reward"] = data["reward"].float()
    return data


class Sb3Side:
    """SB3's model, stepped by its own train() with only the replay sampling replaced."""

    def __init__(self, model, data: dict[str, torch.Tensor], algo: str):
        from stable_baselines3.common.logger import Logger

        self.model, self.algo = model, algo
        model.set_logger(Logger(folder=None, output_formats=[]))  # train() records its losses here
        if algo == "td3":  # SB3's buffer keeps Box actions scaled to [-1, 1] (policy.scale_action)
            action = torch.as_tensor(model.policy.scale_action(data["action"].numpy())).float()
        else:
            action = data["action"].long().reshape(-1, 1)
        self.data = {**data, "action": action}

    def update(self, k: int, rows: torch.Tensor) -> float:
        from stable_baselines3.common.type_aliases import ReplayBufferSamples

        d = self.data
        batch = ReplayBufferSamples(
            observations=d["obs"][rows],
            actions=d["action"][rows],
            next_observations=d["next_obs"][rows],
            dones=d["terminated"][rows].float().reshape(-1, 1),
            rewards=d["reward"][rows].reshape(-1, 1),
        )
        self.model.replay_buffer.sample = lambda *args, **kwargs: batch
        torch.manual_seed(k)
        self.model.train(gradient_steps=1, batch_size=len(rows))
        return self.model.logger.name_to_value[LOSS_KEYS[self.algo][0]]

    def advance(self, before: int, after: int) -> None:
        """The env steps (before, after] counted by SB3's own _on_step (DQN's target copies)."""
        self.model._n_calls = before
        for _ in range(after - before):
            self.model._on_step()


class OurSide:
    """Our algorithm, stepped by its update() on the same rows; the yardstick (walk: a generator) also moves each
    of its values one ulp up or down after every update."""

    def __init__(self, ours, data: dict[str, torch.Tensor], cfg, networks: dict, walk: torch.Generator | None):
        self.ours, self.algo, self.cfg, self.walk = ours, cfg.classes["algo"], cfg.algo, walk
        self.tensors = [t for layer_list in networks.values() for t in params(layer_list)]
        if self.algo == "dqn":  # what our 1-step transitions carry instead of terminated
            self.keys = ("obs", "action", "reward", "next_obs", "discount")
            self.data = {**data, "discount": torch.where(data["terminated"], 0.0, cfg.algo.gamma)}
            self.data["action"] = data["action"].long()
        else:
            self.keys = ("obs", "action", "reward", "next_obs", "terminated")
            self.data = {**data, "action": data["action"].float()}

    def update(self, k: int, rows: torch.Tensor) -> float:
        batch = TensorDict({key: self.data[key][rows] for key in self.keys}, batch_size=[len(rows)])
        torch.manual_seed(k)
        with FlushDenormals():  # as our Trainer runs every learn (SB3 runs unflushed, as users run it)
            loss = self.ours.update(batch)[LOSS_KEYS[self.algo][1]]
        if self.walk is not None:
            nudge(self.tensors, self.walk)
        return loss

    def advance(self, before: int, after: int) -> None:
        """Our target updates for the env steps (before, after], where our learn() makes them."""
        if self.algo != "dqn":
            return
        interval = self.cfg.target_update_interval
        crossed = after // interval - before // interval
        for _ in range(min(crossed, 1) if self.cfg.tau == 1.0 else crossed):
            self.ours.update_target()


class Drift:
    """After each update: the largest |difference| over all networks (SB3 vs ours, ours vs the yardstick), and
    per network the ratio of the two root-mean-square differences, at its largest."""

    def __init__(self, theirs: dict, ours: dict, yardstick: dict):
        self.sides = [{name: params(net) for name, net in side.items()} for side in (theirs, ours, yardstick)]
        self.gaps, self.yard_gaps = [], []
        self.worst = (0.0, "", 0)  # (RMS ratio, network, update)

    def measure(self, k: int) -> None:
        theirs, ours, yardstick = self.sides
        gap = yard_gap = 0.0
        for name in theirs:
            largest, rms = differences(theirs[name], ours[name])
            yard_largest, yard_rms = differences(ours[name], yardstick[name])
            gap, yard_gap = max(gap, largest), max(yard_gap, yard_largest)
            ratio = rms / yard_rms if yard_rms > 0 else (float("inf") if rms > 0 else 0.0)
            if ratio > self.worst[0]:
                self.worst = (ratio, name, k)
        self.gaps.append(gap)
        self.yard_gaps.append(yard_gap)


def compare(config: str, overrides: list[str], updates: int, seed: int) -> dict:
    start = time.perf_counter()
    torch.set_num_threads(1)
    theirs_cfg = load_config(str(ROOT / config), SMALL_BUFFER)
    ours_cfg = load_config(str(ROOT / config), [*SMALL_BUFFER, *overrides, f"train.seed={seed}"])
    algo = theirs_cfg.classes["algo"]
    model, _ = sb3_model(theirs_cfg, seed)
    ours, yardstick = build_ours(ours_cfg), build_ours(ours_cfg)
    nets = sb3_networks(model, algo), our_networks(ours, algo), our_networks(yardstick, algo)
    online = [name for name in nets[0] if not name.endswith("target")]
    init_same, init_what = init_check(*([layer for name in online for layer in side[name]] for side in nets[:2]))
    print(f"{config}: init {'SAME' if init_same else 'DIFFERENT'}: {init_what}", flush=True)
    for name, layer_list in nets[0].items():
        copy_weights(layer_list, nets[1][name])
        copy_weights(layer_list, nets[2][name])
        nudge(params(nets[2][name]))
    data = collect(model, TRANSITIONS, seed)
    walk = torch.Generator().manual_seed(seed + 1)
    sides = [
        Sb3Side(model, data, algo),
        OurSide(ours, data, ours_cfg, nets[1], walk=None),
        OurSide(yardstick, data, ours_cfg, nets[2], walk=walk),
    ]
    drift = Drift(*nets)
    batches = torch.Generator().manual_seed(seed)
    segment = theirs_cfg.algo.num_steps * theirs_cfg.env.num_envs  # SB3's train_freq (one env)
    per_segment = round(theirs_cfg.algo.updates_per_step * segment)  # SB3's gradient_steps
    clock = theirs_cfg.algo.learning_starts // segment * segment  # SB3 trains after the segment that passes it
    losses = []
    for k in range(1, updates + 1):
        if (k - 1) % per_segment == 0:
            for side in sides:
                side.advance(clock, clock + segment)
            clock += segment
        rows = torch.randint(len(data["obs"]), (theirs_cfg.algo.batch_size,), generator=batches)
        losses.append([side.update(k, rows) for side in sides])
        drift.measure(k)
    print_losses(config, losses)
    gaps, yard_gaps, (ratio, network, at) = drift.gaps, drift.yard_gaps, drift.worst
    return dict(
        same=init_same and ratio <= RATIO_TOLERANCE,
        row=[
            f"`{config}`",
            "SAME" if init_same else "DIFFERENT",
            f"{gaps[0]:.2e}",
            f"{max(gaps):.2e} ({np.argmax(gaps) + 1})",
            f"{yard_gaps[0]:.2e}",
            f"{max(yard_gaps):.2e} ({np.argmax(yard_gaps) + 1})",
            f"{max(gaps) / max(yard_gaps):.2f}",
            f"{ratio:.2f} ({network}, {at})" if ratio > 0 else "0 (equal bit for bit)",
            "SAME" if ratio <= RATIO_TOLERANCE else "DIFFERENT",
            f"{time.perf_counter() - start:.0f}",
        ],
    )


def print_losses(config: str, losses: list[list[float]]) -> None:
    shown = sorted({k for k in (1, 10, 100, len(losses)) if k <= len(losses)})
    rows = [[k, *(f"{value:.7g}" for value in losses[k - 1])] for k in shown]
    print(f"{config}: critic / Q losses")
    print(table(["update", "SB3", "ours", "yardstick"], rows), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=None, help="one config (default: the three above in turn)")
    parser.add_argument("--updates", type=int, default=300)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("overrides", nargs="*", help="section.key=value, on our side only")
    args = parser.parse_args()
    print(f"machine: {machine()}\n{versions_line()}")
    if args.overrides:
        print(f"our side only: {' '.join(args.overrides)}")
    configs = [args.config] if args.config else CONFIGS
    results = [compare(config, args.overrides, args.updates, args.seed) for config in configs]
    headers = (
        "config|init|SB3 vs ours: update 1|largest (at)|ours vs yardstick: update 1|largest (at)|ratio of largests|"
        "RMS ratio, largest (network, update)|updates|wall s"
    ).split("|")
    print(
        f"\n{args.updates} updates. |parameter difference|: largest over all networks and targets. RMS ratio: SB3 vs "
        f"ours over ours vs the yardstick (one ulp off, then a random ulp per update), per network and update; "
        f"updates SAME while it is <= {RATIO_TOLERANCE:g}"
    )
    print(table(headers, [r["row"] for r in results]))
    sys.exit(0 if all(r["same"] for r in results) else 1)


if __name__ == "__main__":
    main()
