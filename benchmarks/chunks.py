"""Action chunks pay for themselves, and the fields they bring cost nothing extra on the wire.

    python benchmarks/chunks.py [--parts throughput,wire] [--hidden 768] [--steps 16384] [--repeats 3] [--rounds 5]

throughput: PPO in one process on Pendulum-v1 (a cheap env: tens of microseconds a step) with the built-in
actor-critic made wide enough (policy.hidden_sizes [--hidden, --hidden]) that one forward pass over the 8 envs
costs about a millisecond (measured in the same run, printed), with env.action_chunk 8 against 1. Both run the
same primitive env steps per iteration (8 envs x 64 steps: algo.num_steps 64 decisions of 1 step, or 8 of 8), the
same budget, one update epoch of one minibatch. Primitive env steps per second over the run after its first
iteration (start-up excluded); K = 1 and K = 8 alternate --repeats times, medians.

wire: the messages a split layout sends for examples/instructed_reach/grpo.yaml (a Text instruction as token ids
and a mask, a Dict observation, action chunks of 4, groups of 8, whole episodes, a success flag), laid out as the
framework lays them out (roles/messages.py, from the env's probed spec and the policy's declared outputs), for 16
envs (an env rank of the example's split 5 layout) and 256: the observations (env -> inference, every decision),
the actions (inference -> env: the chunk, its log-prob and value) and the segment (env -> trainer, once a rollout:
the [T, N] rollout with the chunk's K rewards and valid mask, the active mask and the success flags). Groups add
no field (a group is a block of G env columns). Each message is streamed over a channel (benchmarks/comm.py's
pattern: receives posted ahead, one send in flight) against raw isend/irecv of one uint8 tensor of the same
bytes, variants alternating within every round; MB/s and the ratio, medians over --rounds. Beside them, each end's
fixed cost: the CPU time of its main thread per message (time.thread_time, which a wait for the peer or for a core
does not count), channel minus raw, medians. On a busy machine a small message's wall time is mostly waiting for
the scheduler, and the ratio swings from run to run; the CPU time is what the channel adds whatever the load.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace

import gymnasium as gym
import torch
from comm import RECEIVES_AHEAD, _channel_stream, _raw_stream, messages_per_round, spawn
from common import ROOT, machine, run_spmd, table

from spmd_rl.comm.channel_setup import open_channels
from spmd_rl.config import plugins
from spmd_rl.config.loading import load_config
from spmd_rl.envs.chunks import chunk_space
from spmd_rl.envs.vector import probe_env
from spmd_rl.modules.actor_critic import ActorCritic
from spmd_rl.modules.configs import ActorCriticConfig
from spmd_rl.roles.messages import action_message, observation_message, segment_message
from spmd_rl.run.policies import build_policy

EXAMPLE = ROOT / "examples" / "instructed_reach"
CHUNK = 8
ENVS = 8
STEPS_PER_ITERATION = ENVS * 64
# The fields text, chunks and whole episodes bring into the example's messages (the wire table names them)
SHOWN_FIELDS = ("instruction", "action", "reward", "chunk_valid", "active", "episode_success", "episode_success_at_end")


# --- throughput --------------------------------------------------------------------------------------------------


def forward_ms(hidden: int) -> float:
    """One acting forward pass of the benchmark's actor-critic over ENVS Pendulum observations, chunk CHUNK (the
    wider head of the two), in milliseconds: the median of 200 after a warm-up."""
    env = gym.make("Pendulum-v1")
    action_space = chunk_space(env.action_space, CHUNK)
    policy = ActorCritic(env.observation_space, action_space, ActorCriticConfig(hidden_sizes=[hidden, hidden]))
    obs = torch.randn(ENVS, *env.observation_space.shape)
    times = []
    with torch.no_grad():
        for i in range(220):
            start = time.perf_counter()
            policy.act(obs)
            if i >= 20:
                times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def steps_per_second(records: list[dict]) -> float:
    """Primitive env steps per second from the end of the first iteration to the end of the run."""
    first, last = records[0], records[-1]
    return (last["env_steps"] - first["env_steps"]) / (last["wall_s"] - first["wall_s"])


def throughput(hidden: int, steps: int, repeats: int) -> None:
    torch.set_num_threads(1)
    print(f"actor-critic [{hidden}, {hidden}], one acting forward over {ENVS} envs: {forward_ms(hidden):.2f} ms")
    common = [
        "env.id=Pendulum-v1",
        f"env.num_envs={ENVS}",
        f"policy.hidden_sizes=[{hidden},{hidden}]",
        "algo.class=ppo",
        "algo.update_epochs=1",
        "algo.num_minibatches=1",
        f"train.total_steps={steps}",
    ]
    sps: dict[int, list[float]] = {1: [], CHUNK: []}
    for repeat in range(repeats):
        for chunk in (1, CHUNK) if repeat % 2 == 0 else (CHUNK, 1):
            overrides = [*common, f"env.action_chunk={chunk}", f"algo.num_steps={STEPS_PER_ITERATION // ENVS // chunk}"]
            sps[chunk].append(steps_per_second(run_spmd(overrides)))
            print(f"K={chunk} repeat {repeat}: {sps[chunk][-1]:,.0f} primitive steps/s", flush=True)
    one, chunked = statistics.median(sps[1]), statistics.median(sps[CHUNK])
    print(
        table(
            ["env.action_chunk", "primitive env steps/s (median)", "each run", "vs K=1"],
            [
                [1, f"{one:,.0f}", " ".join(f"{x:,.0f}" for x in sps[1]), "1.00x"],
                [CHUNK, f"{chunked:,.0f}", " ".join(f"{x:,.0f}" for x in sps[CHUNK]), f"{chunked / one:.2f}x"],
            ],
        )
    )


# --- wire --------------------------------------------------------------------------------------------------------


def example_messages(num_envs: int) -> dict[str, object]:
    """The example's observation, action and segment messages for num_envs envs of one env rank, random contents."""
    sys.path.insert(0, str(EXAMPLE))  # reach_env, the user's module the config names
    cfg = load_config(EXAMPLE / "grpo.yaml", [f"env.num_envs={num_envs}"])
    spec = replace(probe_env(cfg.env), episodes=True)  # GRPO's rollouts are whole episodes, as its plan says
    policy = build_policy(cfg, spec, plugins.load_class(plugins.POLICY, cfg.classes["policy"]))
    decisions = math.ceil(cfg.env.max_episode_steps / cfg.env.action_chunk)  # a rollout of whole episodes
    messages = {
        "observations": observation_message(spec, num_envs),
        "actions": action_message(policy.outputs(), num_envs),
        "segment": segment_message(spec, policy.outputs(), decisions, num_envs),
    }
    for message in messages.values():
        for leaf in message.values(True, True):  # contents do not matter to the wire; zeros could hide a copy
            leaf.copy_(torch.randint(0, 2 if leaf.dtype == torch.bool else 100, leaf.shape))
    return messages


def nbytes_of(message) -> int:
    return sum(leaf.numel() * leaf.element_size() for leaf in message.values(True, True))


def wire_ranks(rank: int, world_size: int, messages: dict, rounds: int, out_dir: str) -> None:
    """Rank 0 streams each message to rank 1 over a channel and raw, alternating. Rank 0 writes the MB/s medians
    to out_dir/wire.json; each rank writes its main thread's CPU microseconds per message to out_dir/cpu{rank}.json."""
    ack = torch.zeros(1)
    out, cpu_us = {}, {}
    for name, message in messages.items():
        stream = open_channels(
            sends=[(1, name, message)] if rank == 0 else [],
            recvs=[(0, name, message)] if rank == 1 else [],
            me=rank,
            timeout=120,
            num_recv_buffers=RECEIVES_AHEAD + 1,
        )
        nbytes = nbytes_of(message)
        raw_buffers = [torch.zeros(nbytes, dtype=torch.uint8) for _ in range(RECEIVES_AHEAD + 1)]
        count = messages_per_round(nbytes)
        timings: dict[str, list[float]] = {"raw": [], "channel": []}
        cpu: dict[str, list[float]] = {"raw": [], "channel": []}
        for round_ in range(rounds + 1):  # round 0 warms up
            for variant in ("raw", "channel") if round_ % 2 == 0 else ("channel", "raw"):
                cpu_start = time.thread_time()
                seconds = (
                    _raw_stream(rank, count, raw_buffers, ack)
                    if variant == "raw"
                    else _channel_stream(rank, count, stream, None, ack)
                )
                if round_ > 0:
                    timings[variant].append(seconds)
                    cpu[variant].append(time.thread_time() - cpu_start)
        out[name] = {variant: nbytes * count / statistics.median(t) / 2**20 for variant, t in timings.items()}
        cpu_us[name] = {variant: statistics.median(t) / count * 1e6 for variant, t in cpu.items()}
    with open(f"{out_dir}/cpu{rank}.json", "w") as f:
        json.dump(cpu_us, f)
    if rank == 0:
        with open(f"{out_dir}/wire.json", "w") as f:
            json.dump(out, f)


def wire(envs: list[int], rounds: int) -> None:
    rows = []
    for num_envs in envs:
        messages = example_messages(num_envs)
        with tempfile.TemporaryDirectory() as tmp:
            spawn(wire_ranks, 2, messages, rounds, tmp)
            with open(f"{tmp}/wire.json") as f:
                measured = json.load(f)
            cpu_us = []
            for rank in (0, 1):
                with open(f"{tmp}/cpu{rank}.json") as f:
                    cpu_us.append(json.load(f))
        for name, message in messages.items():
            raw, channel = measured[name]["raw"], measured[name]["channel"]
            paths = {"/".join(key) if isinstance(key, tuple) else key: leaf for key, leaf in message.items(True, True)}
            keys = ", ".join(
                f"{path} {list(leaf.shape)} {str(leaf.dtype).removeprefix('torch.')}"
                for path, leaf in paths.items()
                if not path.startswith("next_obs") and any(word in path.split("/") for word in SHOWN_FIELDS)
            )
            extra_us = [each[name]["channel"] - each[name]["raw"] for each in cpu_us]
            rows.append(
                [
                    num_envs,
                    name,
                    f"{nbytes_of(message):,}",
                    f"{raw:.0f}",
                    f"{channel:.0f}",
                    f"{channel / raw:.2f}",
                    f"{cpu_us[0][name]['raw']:.1f}, {cpu_us[1][name]['raw']:.1f}",
                    f"{extra_us[0]:+.1f}, {extra_us[1]:+.1f}",
                    keys,
                ]
            )
    print(
        table(
            [
                "envs",
                "message",
                "bytes",
                "raw MB/s",
                "channel MB/s",
                "ratio",
                "raw CPU us/msg (send, recv)",
                "channel - raw CPU us/msg (send, recv)",
                "text, chunk and episode fields",
            ],
            rows,
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="throughput,wire")
    parser.add_argument("--hidden", type=int, default=768, help="the actor-critic's hidden width (forward ~1 ms)")
    parser.add_argument("--steps", type=int, default=16384, help="train.total_steps of each throughput run")
    parser.add_argument("--repeats", type=int, default=3, help="throughput runs per chunk size")
    parser.add_argument("--envs", default="16,256", help="wire: env counts of one env rank")
    parser.add_argument("--rounds", type=int, default=5, help="wire: rounds per message; numbers are medians")
    args = parser.parse_args()
    print(f"machine: {machine()}; load average at start {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    parts = args.parts.split(",")
    if "throughput" in parts:
        throughput(args.hidden, args.steps, args.repeats)
    if "wire" in parts:
        wire([int(n) for n in args.envs.split(",")], args.rounds)
    print(f"load average at the end {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
