"""Channels and weight broadcast against raw torch.distributed on the same machine, in the same run.

    python benchmarks/comm.py [--max-mb 64] [--rounds 5]

Point to point (2 ranks, gloo, CPU): a channel carrying a TensorDict of four keys (float32, float64, int64, uint8)
that total the payload, against raw isend/irecv of ONE uint8 tensor of the same bytes. Both run the same pattern:
the sender waits for its previous send before the next (a buffer is reused only once its send is done) and the
receiver keeps two receives posted ahead of the message it holds, over three buffers. (A gloo send completes only
once the matching receive is posted, and a send that arrives before its receive takes a slower path; receives
posted ahead keep both variants on the fast path instead of racing the sender.)
- throughput: a stream of messages, timed from the first send to the receiver's acknowledgement of the last;
- round trip: ping-pong of one message each way (blocking send and receive), median;
- CPU per message: the stream's CPU time (both ranks, all their threads, gloo's included) per message over all
  rounds. It moves under load too (gloo's threads poll while they wait), though less than the wall-clock columns.
"channel" sends the buffer a role wrote in place; "channel+copy" passes a separate TensorDict (one copy more).

Weight broadcast (3 ranks: 1 source, 2 receivers): WeightSync of a module of that many bytes (float32 weights,
float64 normalizer statistics, an int64 counter) against dist.broadcast of one uint8 tensor of the same bytes;
a few broadcasts back to back, then a barrier, per broadcast.

Variants alternate within every round so machine noise hits them alike; each number is a median over rounds.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import platform
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from tensordict import TensorDict
from torch import nn

from spmd_rl.comm.channel_setup import open_channels
from spmd_rl.comm.weights import WeightSync

TIMEOUT = datetime.timedelta(seconds=120)
KB, MB = 1 << 10, 1 << 20


def payload(nbytes: int) -> TensorDict:
    """Four keys of four dtypes totalling nbytes (nbytes a multiple of 64)."""
    quarter = nbytes // 4
    return TensorDict(
        {
            "obs": torch.randn(quarter // 4),
            "value": torch.randn(quarter // 8, dtype=torch.float64),
            "action": torch.randint(0, 9, (quarter // 8,)),
            "pixels": torch.randint(0, 255, (nbytes - 3 * quarter,), dtype=torch.uint8),
        },
        batch_size=[],
    )


class SizedModule(nn.Module):
    """A policy-like module of about nbytes: float32 weights, float64 statistics, an int64 counter."""

    def __init__(self, nbytes: int):
        super().__init__()
        stats = max(1, nbytes // 64)  # 1/8 of the bytes, as float64
        self.weight = nn.Parameter(torch.randn((nbytes - 8 * stats - 8) // 4))
        self.register_buffer("mean", torch.randn(stats, dtype=torch.float64))
        self.register_buffer("count", torch.zeros((), dtype=torch.int64))


def messages_per_round(nbytes: int) -> int:
    return max(3, min(500, (16 * MB) // nbytes))


# --- point to point ----------------------------------------------------------------------------------------------

RECEIVES_AHEAD = 2


def _raw_stream(rank: int, count: int, buffers: list[torch.Tensor], ack: torch.Tensor) -> float:
    start = time.perf_counter()
    if rank == 0:
        previous = None
        for _ in range(count):
            if previous is not None:
                previous.wait(TIMEOUT)
            previous = dist.isend(buffers[0], dst=1)
        previous.wait(TIMEOUT)
        dist.recv(ack, src=1)
    else:
        pending = [dist.irecv(buffers[i], src=0) for i in range(RECEIVES_AHEAD)]
        for i in range(count):
            pending.pop(0).wait(TIMEOUT)
            if i + RECEIVES_AHEAD < count:
                pending.append(dist.irecv(buffers[(i + RECEIVES_AHEAD) % len(buffers)], src=0))
        dist.send(ack, dst=0)
    return time.perf_counter() - start


def _channel_stream(rank: int, count: int, channels, message: TensorDict | None, ack: torch.Tensor) -> float:
    start = time.perf_counter()
    if rank == 0:
        (out,), _ = channels
        for _ in range(count):
            out.isend(message)
        out.wait()
        dist.recv(ack, src=1)
    else:
        _, (inbox,) = channels
        pending = [inbox.irecv() for _ in range(RECEIVES_AHEAD)]
        for i in range(count):
            pending.pop(0).wait()
            if i + RECEIVES_AHEAD < count:
                pending.append(inbox.irecv())
        dist.send(ack, dst=0)
    return time.perf_counter() - start


def _raw_round_trips(rank: int, count: int, tensor: torch.Tensor) -> list[float]:
    times = []
    for _ in range(count):
        start = time.perf_counter()
        if rank == 0:
            dist.send(tensor, dst=1)
            dist.recv(tensor, src=1)
        else:
            dist.recv(tensor, src=0)
            dist.send(tensor, dst=0)
        times.append(time.perf_counter() - start)
    return times


def _channel_round_trips(rank: int, count: int, to_peer, from_peer) -> list[float]:
    times = []
    for _ in range(count):
        start = time.perf_counter()
        if rank == 0:
            to_peer.send()
            from_peer.recv()
        else:
            from_peer.recv()
            to_peer.send()  # replies from its own buffer, as raw replies with the tensor it received
        times.append(time.perf_counter() - start)
    return times


def point_to_point(rank: int, world_size: int, sizes: list[int], rounds: int, out_path: str) -> None:
    results = {}
    ack = torch.zeros(1)
    for nbytes in sizes:
        example = payload(nbytes)
        peer = 1 - rank
        stream = open_channels(
            sends=[(1, "stream", example)] if rank == 0 else [],
            recvs=[(0, "stream", example)] if rank == 1 else [],
            me=rank,
            timeout=TIMEOUT,
            num_recv_buffers=RECEIVES_AHEAD + 1,
        )
        (to_peer,), (from_peer,) = open_channels(
            sends=[(peer, "ping" if rank == 0 else "pong", example)],
            recvs=[(peer, "pong" if rank == 0 else "ping", example)],
            me=rank,
            timeout=TIMEOUT,
        )
        raw_buffers = [torch.zeros(nbytes, dtype=torch.uint8) for _ in range(RECEIVES_AHEAD + 1)]
        count = messages_per_round(nbytes)
        trips = max(5, min(300, count // 2))
        measures = {
            "raw": lambda: [_raw_stream(rank, count, raw_buffers, ack)],
            "channel": lambda: [_channel_stream(rank, count, stream, None, ack)],
            "channel+copy": lambda: [_channel_stream(rank, count, stream, example, ack)],
            "raw_rtt": lambda: _raw_round_trips(rank, trips, raw_buffers[0]),
            "channel_rtt": lambda: _channel_round_trips(rank, trips, to_peer, from_peer),
        }
        timings = {name: [] for name in measures}
        cpu_s = dict.fromkeys(measures, 0.0)  # this rank's CPU time, all threads
        order = list(measures)
        for round_ in range(rounds + 1):  # round 0 warms up (first-touch pages, connections)
            for name in order[round_ % len(order) :] + order[: round_ % len(order)]:  # rotate: no variant always first
                cpu_before = time.process_time()
                measured = measures[name]()
                if round_ > 0:
                    timings[name] += measured
                    cpu_s[name] += time.process_time() - cpu_before
        # CPU per streamed message, sender and receiver together (rank 1 sends its own to rank 0)
        streams = ("raw", "channel", "channel+copy")
        cpu_per_message = torch.tensor([cpu_s[name] / (rounds * count) for name in streams], dtype=torch.float64)
        peer_cpu = torch.zeros_like(cpu_per_message)
        if rank == 1:
            dist.send(cpu_per_message, dst=0)
        else:
            dist.recv(peer_cpu, src=1)
        both_ranks = dict(zip(streams, (cpu_per_message + peer_cpu).tolist(), strict=True))
        if rank == 0:
            results[nbytes] = {
                "raw_MBps": nbytes * count / statistics.median(timings["raw"]) / MB,
                "channel_MBps": nbytes * count / statistics.median(timings["channel"]) / MB,
                "copy_MBps": nbytes * count / statistics.median(timings["channel+copy"]) / MB,
                "raw_rtt_us": statistics.median(timings["raw_rtt"]) * 1e6,
                "channel_rtt_us": statistics.median(timings["channel_rtt"]) * 1e6,
                "raw_cpu_us": both_ranks["raw"] * 1e6,
                "channel_cpu_us": both_ranks["channel"] * 1e6,
                "copy_cpu_us": both_ranks["channel+copy"] * 1e6,
            }
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)


# --- weight broadcast --------------------------------------------------------------------------------------------


def _timed_broadcasts(count: int, broadcast) -> float:
    start = time.perf_counter()
    for _ in range(count):
        broadcast()
    dist.barrier()
    return (time.perf_counter() - start) / count


def weight_broadcast(rank: int, world_size: int, sizes: list[int], rounds: int, out_path: str) -> None:
    results = {}
    group = dist.group.WORLD
    for nbytes in sizes:
        module = SizedModule(nbytes)
        sync = WeightSync(module, group, src=0, me=rank, bucket_bytes=64 * MB, timeout=TIMEOUT)
        flat = torch.zeros(sum(b.numel() for b in sync.buckets), dtype=torch.uint8)
        count = max(2, messages_per_round(nbytes) // 4)
        raw, ours = [], []
        for version in range(rounds + 1):  # round 0 warms up; odd rounds run ours first
            measured = {}
            for name in ("raw", "ours") if version % 2 == 0 else ("ours", "raw"):
                measured[name] = (
                    _timed_broadcasts(count, lambda: dist.broadcast(flat, src=0, group=group))
                    if name == "raw"
                    else _timed_broadcasts(count, lambda: sync.broadcast(version))
                )
            if version > 0:
                raw.append(measured["raw"])
                ours.append(measured["ours"])
        sync.verify(rounds)
        if rank == 0:
            results[nbytes] = {
                "raw_MBps": flat.numel() / statistics.median(raw) / MB,
                "weights_MBps": flat.numel() / statistics.median(ours) / MB,
                "buckets": len(sync.buckets),
            }
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)


# --- driver ------------------------------------------------------------------------------------------------------


def _rank_main(fn, rank: int, world_size: int, init_method: str, args: tuple) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size, timeout=TIMEOUT)
    fn(rank, world_size, *args)
    dist.barrier()
    dist.destroy_process_group()


def spawn(fn, world_size: int, *args) -> None:
    with tempfile.TemporaryDirectory() as store:
        context = multiprocessing.get_context("fork")
        ranks = [
            context.Process(target=_rank_main, args=(fn, rank, world_size, f"file://{store}/store", args))
            for rank in range(world_size)
        ]
        for process in ranks:
            process.start()
        for process in ranks:
            process.join(600)
        for process in ranks:
            if process.is_alive():
                process.kill()
                process.join()
        codes = [process.exitcode for process in ranks]
        if any(codes):
            sys.exit(f"{fn.__name__}: ranks exited with {codes}")


def human(nbytes: int) -> str:
    return f"{nbytes // MB} MB" if nbytes >= MB else f"{nbytes // KB} KB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-mb", type=int, default=64, help="largest payload, MB (payloads 1 KB x4 up to it)")
    parser.add_argument("--rounds", type=int, default=9, help="rounds per payload; numbers are medians over them")
    args = parser.parse_args()
    if args.max_mb < 1 or args.rounds < 1:
        parser.error("--max-mb and --rounds must be >= 1")
    sizes = [KB * 4**i for i in range(20) if KB * 4**i <= args.max_mb * MB]

    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        spawn(point_to_point, 2, sizes, args.rounds, f"{tmp}/p2p.json")
        spawn(weight_broadcast, 3, sizes, args.rounds, f"{tmp}/bcast.json")
        with open(f"{tmp}/p2p.json") as f:
            p2p = json.load(f)
        with open(f"{tmp}/bcast.json") as f:
            bcast = json.load(f)

    cpu = platform.processor() or platform.machine()
    print(
        f"torch {torch.__version__}, gloo on CPU, {os.cpu_count()} cores, {cpu}, {args.rounds} rounds, medians; "
        f"ratio = ours / raw (higher is better for MB/s, lower for round trip)"
    )
    header = (
        "payload",
        "raw MB/s",
        "channel MB/s",
        "ratio",
        "ch+copy MB/s",
        "ratio",
        "raw RTT us",
        "channel RTT us",
        "ratio",
        "raw CPU us/msg",
        "channel CPU us/msg",
        "ratio",
        "ch+copy CPU us/msg",
        "raw bcast MB/s",
        "weights MB/s",
        "ratio",
    )
    rows = []
    for nbytes in sizes:
        p, b = p2p[str(nbytes)], bcast[str(nbytes)]
        rows.append(
            (
                human(nbytes),
                f"{p['raw_MBps']:.0f}",
                f"{p['channel_MBps']:.0f}",
                f"{p['channel_MBps'] / p['raw_MBps']:.2f}",
                f"{p['copy_MBps']:.0f}",
                f"{p['copy_MBps'] / p['raw_MBps']:.2f}",
                f"{p['raw_rtt_us']:.0f}",
                f"{p['channel_rtt_us']:.0f}",
                f"{p['channel_rtt_us'] / p['raw_rtt_us']:.2f}",
                f"{p['raw_cpu_us']:.0f}",
                f"{p['channel_cpu_us']:.0f}",
                f"{p['channel_cpu_us'] / p['raw_cpu_us']:.2f}",
                f"{p['copy_cpu_us']:.0f}",
                f"{b['raw_MBps']:.0f}",
                f"{b['weights_MBps']:.0f}",
                f"{b['weights_MBps'] / b['raw_MBps']:.2f}",
            )
        )
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    print("| " + " | ".join(h.rjust(w) for h, w in zip(header, widths)) + " |")
    print("|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|")
    for row in rows:
        print("| " + " | ".join(c.rjust(w) for c, w in zip(row, widths)) + " |")
    print(f"({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
