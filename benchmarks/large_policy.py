"""Large policies on CPU ranks over gloo: trainer memory with FSDP2 vs DDP, bytes and time of a weight sync from
shards (fp32 and bf16 on the wire; two designs: "gathered", every bucket all-gathered in the trainer group and
broadcast by trainer 0, and "sent", every trainer sending its own rows to the inference ranks) and from replicated
(ddp) trainers ("replicated": trainer 0 casts each bucket to the wire dtype and broadcasts it) against a raw
dist.broadcast of the same bytes, the extra memory a sync takes on a trainer, a frozen backbone's later syncs, and a
7B sync on paper from the measured per-bucket overhead.

    python benchmarks/large_policy.py                  # 100M and 300M parameters
    python benchmarks/large_policy.py --sizes 20       # quicker: 20M
    python benchmarks/large_policy.py --vla small      # the vla policy (91M) built once where it runs (below)
    python benchmarks/large_policy.py --sizes 40 --designs sent --pairs 9 --bucket-mb 8   # per-bucket overhead

--vla PRESET: the vla policy from a PaliGemma folder this script writes (save_pretrained of the preset), split over
5 ranks (2 env, 1 inference, 2 fsdp trainers) through torchrun, against the same layout with a small actor-critic
MLP: start-up (launch to the first metrics line, the first iteration included; and that less iteration 0's own
rollout, learning and weight sync times from its record: the start-up before iteration 0 began) against the time
one process takes to import, build and load the folder's weights, and the CPU seconds the busiest rank had spent
before iteration 0 began against that process's (with a core per rank, the floor of the start-up: on fewer cores
than ranks the wall times measure the core count too); each rank's peak RSS and policy builds
(finished.json's "ranks"; a sharded trainer other than trainer 0 builds the policy on the meta device and takes its
shards from trainer 0's); the trainers' training state (weights, gradients, Adam's moments) with LoRA rank 16
against full fine-tuning, counted on the policy built on the meta device; and the bytes of a weight sync after the
first (the frozen base travels only with the first), from the weight sync's own bucket layout of that policy.

The model is a stack of square Linear layers (width 2048: 4.2M parameters a layer), built on the meta device and
materialized after sharding, so no rank ever holds the whole model except where the measurement says so. Ranks are
forked processes meeting through a file:// store: 2 trainers (FSDP over both, but "replicated"), 2 inference ranks
(the weight group is trainer 0 + the inference ranks). Memory is counted from the tensors themselves (parameters,
gradients, Adam's two moments), and a sync's extra memory as the growth of the process's peak RSS during it.

Time on a shared machine: a sync and a raw broadcast of the same bytes alternate (A B, B A, ...) for --pairs rounds,
each after a barrier of all four ranks and timed from the first rank's start to the last rank's end (an inference
rank holds the weights only when its receives complete); the ratio reported is the median of the rounds' ratios, and
beside it the ratio of the CPU seconds the four processes spent (all their threads, the kernel's socket copies
included), which depends less on what else the machine runs. The on-paper 7B row takes the software overhead per
bucket measured here, over gloo between CPU processes: a GPU's per-bucket overhead over NCCL is not measured.
The overhead is the median over the rounds of (sync - raw) / buckets, with its lowest and highest round, and the
same in the four ranks' CPU seconds. With the default 64 MiB buckets a 40M policy is 2 buckets in bf16, and one
round's overhead per bucket then swings by more than ten times the 2 ms target on a shared machine: --bucket-mb 8
makes the same bytes 20 buckets (each layer's 8 MiB weight one, its 4 KiB bias the next), so that costs paid per
bucket (and per piece) add up to what a round can resolve; the 7B row then counts buckets of that size.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import multiprocessing
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import ROOT, command, machine, table  # noqa: E402
from spmd_rl.comm import sharding  # noqa: E402
from spmd_rl.comm.weight_sources import GatheredWeightSource, ShardedWeightSource  # noqa: E402
from spmd_rl.comm.weights import WeightSync  # noqa: E402

WIDTH = 2048
BUCKET_MB = 64
PAIRS = 9  # rounds of (sync, raw broadcast of the same bytes), alternating which goes first; medians
PAPER_PARAMETERS, PAPER_LINK_BYTES_S = 7e9, 50e9  # the on-paper sync: a 7B policy over a 50 GB/s link


class Stack(nn.Module):
    def __init__(self, layers: int, frozen_layers: int = 0):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(layers))
        for block in list(self.blocks)[:frozen_layers]:
            block.requires_grad_(False)

    def shard_units(self):
        return list(self.blocks)

    def forward(self, x):
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _local_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        t = t.to_local() if sharding.is_dtensor(t) else t
        total += t.numel() * t.element_size()
    return total


def _timed(records: list, round_: int, what: str, step) -> None:
    """step() after a barrier of all ranks; (round, what, start, end, CPU seconds) appended to records. Every
    rank's clock is the same (perf_counter is CLOCK_MONOTONIC, system-wide), so the parent can take the span from
    the first start to the last end."""
    dist.barrier()
    cpu, start = time.process_time(), time.perf_counter()
    step()
    records.append((round_, what, start, time.perf_counter(), time.process_time() - cpu))


def _rounds(pairs: int, sync, raw) -> list:
    """pairs rounds of a sync and a raw broadcast, the first of the two alternating; every rank's records."""
    records: list = []
    for round_ in range(pairs):
        steps = [("sync", sync), ("raw", raw)]
        for what, step in steps if round_ % 2 == 0 else steps[::-1]:
            _timed(records, round_, what, step)
    return records


def _rank(
    rank: int,
    world: int,
    init: str,
    out: str,
    layers: int,
    wire: str,
    frozen: int,
    design: str,
    pairs: int,
    bucket: int,
):
    """One rank of the FSDP measurement: ranks 0-1 sharded trainers, ranks 2-3 inference ranks; buckets of at most
    `bucket` bytes."""
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=datetime.timedelta(600))
    torch.set_num_threads(1)
    trainers, weights = dist.new_group([0, 1]), dist.new_group([0, 2, 3])
    # design "sent": trainers 0 and 1 send their rows to ranks 2 and 3 over the world group (all four ranks)
    senders = {"senders": [0, 1], "sender_group": dist.group.WORLD} if design == "sent" else {}
    wire_dtype = torch.bfloat16 if wire == "bf16" else None
    result = {}
    if rank >= 2:  # an inference rank: the whole model, plain, in the wire dtype
        net = Stack(layers, frozen)
        if wire_dtype is not None:
            sharding.cast_parameters(net, wire_dtype)
        sync = WeightSync(net, weights, src=0, me=rank, bucket_bytes=bucket, timeout=600, **senders)
        raw = torch.zeros(sum(sync.bucket_sizes[i] for i in range(sync.live_buckets)), dtype=torch.uint8)
        sync.broadcast(-1)
        records = _rounds(pairs, lambda: sync.broadcast(-1), lambda: dist.broadcast(raw, src=0, group=weights))
        _save(out, rank, "fsdp", {"records": records})
        return
    with torch.device("meta"):
        net = Stack(layers, frozen)
    if design != "replicated":  # replicated: ddp's trainers, each with the whole model
        sharding.shard_policy(net, trainers, torch.device("cpu"), [], bf16=False)
    net.to_empty(device="cpu")
    for block in net.blocks:  # any values: the measurements do not depend on them
        nn.init.uniform_(block.weight, -0.02, 0.02)
        nn.init.zeros_(block.bias)
    kind, options = (ShardedWeightSource, dict(senders, receivers=[2, 3])) if senders else (GatheredWeightSource, {})
    source = kind(
        net, weights if rank == 0 else None, src=0, me=rank, bucket_bytes=bucket, timeout=600, wire_dtype=wire_dtype,
        **options,
    )  # fmt: skip
    later_bytes = sum(source.bucket_sizes[i] for i in range(source.live_buckets))
    raw = torch.zeros(later_bytes, dtype=torch.uint8) if rank == 0 else None  # zeros: its pages touched now
    before = _peak_rss_bytes()
    source.broadcast(0)  # the first also carries the frozen layers; later ones only what trains
    versions = iter(range(1, pairs + 1))
    result["records"] = _rounds(
        pairs,
        lambda: source.broadcast(next(versions)),
        lambda: dist.broadcast(raw, src=0, group=weights) if rank == 0 else None,  # trainer 1 is not in it
    )
    result["sync_peak_extra_bytes"] = _peak_rss_bytes() - before
    result["bucket_bytes"] = max(source.bucket_sizes)
    result["all_bytes"] = sum(source.bucket_sizes)
    result["later_sync_bytes"] = sum(source.bucket_sizes[i] for i in range(source.live_buckets))
    result["buckets_later"] = source.live_buckets
    result["trainable_wire_bytes"] = sum(e.nbytes for e in source.entries if not e.frozen)
    # Training memory, measured after the syncs so that the syncs' peak is not hidden by the backward's.
    trainable = [p for p in net.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(trainable, lr=1e-4, fused=True)
    net(torch.randn(4, WIDTH)).square().mean().backward()
    optimizer.step()
    states = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim()]
    result["train_bytes"] = _local_bytes(
        [*net.parameters(), *(p.grad for p in trainable if p.grad is not None), *states]
    )
    result["parameters"] = sum(p.numel() for p in net.parameters())
    _save(out, rank, "fsdp", result)


def _save(out: str, rank: int, parallel: str, result: dict) -> None:
    torch.save(result, f"{out}/{parallel}_rank{rank}.pt")


def _child(*args):
    try:
        _rank(*args)
    except BaseException:
        import traceback

        traceback.print_exc()
        os._exit(1)
    os._exit(0)


def _times(records_by_rank: list[list]) -> dict:
    """Per round, each step's span over all ranks (first start to last end) and CPU seconds (all ranks)."""
    rounds: dict[int, dict] = {}
    for steps in zip(*records_by_rank):
        (round_, what, *_), spans = steps[0], [step[2:] for step in steps]
        wall = max(end for _, end, _ in spans) - min(start for start, _, _ in spans)
        rounds.setdefault(round_, {})[what] = (wall, sum(cpu for *_, cpu in spans))
    sync = [r["sync"][0] for r in rounds.values()]
    raw = [r["raw"][0] for r in rounds.values()]
    return {
        "sync_s": statistics.median(sync),
        "raw_broadcast_s": statistics.median(raw),
        "ratio": statistics.median(r["raw"][0] / r["sync"][0] for r in rounds.values()),
        "ratio_low_high": (
            min(r["raw"][0] / r["sync"][0] for r in rounds.values()),
            max(r["raw"][0] / r["sync"][0] for r in rounds.values()),
        ),
        "cpu_ratio": statistics.median(r["raw"][1] / r["sync"][1] for r in rounds.values()),
        "overhead_s": statistics.median(r["sync"][0] - r["raw"][0] for r in rounds.values()),
        "overhead_low_high": (
            min(r["sync"][0] - r["raw"][0] for r in rounds.values()),
            max(r["sync"][0] - r["raw"][0] for r in rounds.values()),
        ),
        "cpu_overhead_s": statistics.median(r["sync"][1] - r["raw"][1] for r in rounds.values()),
    }


def measure(
    layers: int,
    parallel: str,
    wire: str,
    frozen: int = 0,
    design: str = "gathered",
    pairs: int = PAIRS,
    bucket_mb: int = BUCKET_MB,
) -> dict:
    out = tempfile.mkdtemp(prefix="spmd_large_")
    load = f"{os.getloadavg()[0]:.1f}"
    init = "file://" + os.path.join(out, "store")
    context = multiprocessing.get_context("fork")
    if parallel == "fsdp":  # 2 trainers and 2 inference ranks
        children = [
            context.Process(target=_child, args=(r, 4, init, out, layers, wire, frozen, design, pairs, bucket_mb << 20))
            for r in range(4)
        ]
    else:  # only the two trainers: the ddp measurement is memory alone
        children = [context.Process(target=_ddp_child, args=(r, init, out, layers)) for r in range(2)]
    for child in children:
        child.start()
    for child in children:
        child.join(1800)
    load += f"-{os.getloadavg()[0]:.1f}"
    if any(child.exitcode != 0 for child in children):
        raise RuntimeError(f"{parallel} {wire} {design} layers={layers}: a rank failed")
    result = torch.load(f"{out}/{parallel}_rank0.pt")
    if parallel == "fsdp":
        result.update(_times([torch.load(f"{out}/fsdp_rank{r}.pt")["records"] for r in range(4)]))
    shutil.rmtree(out, ignore_errors=True)
    result["load"] = load
    return result


def _ddp_child(rank: int, init: str, out: str, layers: int):
    try:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2, timeout=datetime.timedelta(600))
        torch.set_num_threads(1)
        group = dist.group.WORLD
        with torch.device("meta"):
            net = Stack(layers)
        net.to_empty(device="cpu")
        optimizer = torch.optim.Adam(net.parameters(), lr=1e-4, fused=True)
        net = nn.parallel.DistributedDataParallel(net, process_group=group)
        net(torch.randn(4, WIDTH)).square().mean().backward()
        optimizer.step()
        states = [v for s in optimizer.state.values() for v in s.values() if v.dim()]
        result = {
            "train_bytes": _local_bytes([*net.parameters(), *(p.grad for p in net.parameters()), *states]),
            "parameters": sum(p.numel() for p in net.parameters()),
        }
        _save(out, rank, "ddp", result)
    except BaseException:
        import traceback

        traceback.print_exc()
        os._exit(1)
    os._exit(0)


VLA_ENV = "env.id=tests.harness.vla_fixtures:InstructedReach-v0"
SPLIT_5 = ["layout.mode=split", "layout.trainer=2", "layout.inference=1", "layout.env=2", "train.parallel=fsdp"]


def _vla_folder(preset: str, folder: Path) -> int:
    """A PaliGemma folder of the preset's architecture (its initial weights), as save_pretrained writes it; the
    parameter count."""
    from spmd_rl.modules.configs import VLAConfig
    from spmd_rl.modules.vla import build_backbone

    backbone, _, _ = build_backbone(VLAConfig(preset=preset))
    backbone.save_pretrained(folder, max_shard_size="100MB")
    return sum(p.numel() for p in backbone.parameters())


def _load_once_s(folder: Path) -> tuple[float, float]:
    """(seconds, CPU seconds) for one fresh process to import, build the vla policy and read the folder's weights."""
    code = (
        "import sys; sys.path.insert(0, 'tests'); from harness.vla_fixtures import InstructedReach; "
        "from spmd_rl.modules.configs import VLAConfig; from spmd_rl.modules.vla import VLAPolicy; env = "
        f"InstructedReach(); VLAPolicy(env.observation_space, env.action_space, VLAConfig(pretrained='{folder}'))"
    )
    started, cpu = time.monotonic(), _children_cpu_s()
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    return time.monotonic() - started, _children_cpu_s() - cpu


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _ranks_cpu_s(launcher: int) -> dict[int, float]:
    """{pid: CPU seconds so far} of the ranks torchrun's agent `launcher` started (its children running spmd_rl)."""
    ticks = os.sysconf("SC_CLK_TCK")
    found = {}
    try:
        children = Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split()
    except OSError:
        return found
    for pid in children:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        found[int(pid)] = (int(fields[11]) + int(fields[12])) / ticks  # utime, stime (stat fields 14, 15)
    return found


def _split_run(overrides: list[str], run_dir: Path) -> tuple[float, float, float, list[dict]]:
    """(seconds from launch to the first metrics line, iteration 0's own seconds, the most CPU seconds one rank had
    spent before iteration 0 began, finished.json's ranks) of a 2-iteration split-5 run. Iteration 0's own time is
    its record's rollout, learning and weight sync times: the first line less that is the start-up before iteration
    0 began."""
    args = ["--config", "configs/ci_tiny.yaml", VLA_ENV, *SPLIT_5, f"run.dir={run_dir}", "train.total_steps=128"]
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    started = time.monotonic()
    job = subprocess.Popen(
        [*command("torchrun", 5), *args, *overrides, "dist.timeout_s=900"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    first_line, samples = None, []  # (seconds since launch, {rank pid: CPU seconds so far})
    while job.poll() is None:
        metrics = run_dir / "metrics.jsonl"
        if first_line is None:
            samples.append((time.monotonic() - started, _ranks_cpu_s(job.pid)))
            if metrics.exists() and metrics.stat().st_size:
                first_line = time.monotonic() - started
        time.sleep(0.2)
    if job.returncode != 0:
        raise RuntimeError(f"split run {overrides} failed ({job.returncode}): {job.stderr.read()[-3000:]}")
    assert first_line is not None  # a finished run logged its iterations
    first = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    iteration_0 = sum(first.get(key, 0.0) for key in ("time_rollout_s", "time_learn_s", "time_weight_sync_s"))
    ranks = json.loads((run_dir / "finished.json").read_text())["ranks"]
    # the busiest rank's CPU seconds at the last sample before iteration 0 began (a rank's CPU only grows)
    before = [max(cpu.values()) for at, cpu in samples if cpu and at <= first_line - iteration_0]
    return first_line, iteration_0, max(before, default=math.nan), ranks


def _vla_paper(folder: Path, lora_rank: int) -> dict:
    """On the policy built on the meta device: parameters, the training state of one of 2 fsdp trainers (16 bytes a
    trained parameter, its weight for a frozen one) and the bytes of every weight sync after the first."""
    from spmd_rl.comm.weights import lay_out
    from spmd_rl.config.loading import load_config
    from spmd_rl.envs.vector import probe_env
    from spmd_rl.run.contract import load_classes
    from spmd_rl.run.policies import policy_on_meta

    cfg = load_config(
        None, [VLA_ENV, "policy.class=vla", f"policy.pretrained={folder}", f"policy.lora.rank={lora_rank}"]
    )
    policy = policy_on_meta(cfg, probe_env(cfg.env), load_classes(cfg)[0])
    trained = sum(p.numel() for p in policy.parameters() if p.requires_grad)
    frozen = sum(p.numel() * p.element_size() for p in policy.parameters() if not p.requires_grad)
    entries, sizes = lay_out(policy, BUCKET_MB * 2**20)
    first_frozen = min([e.bucket for e in entries if e.frozen], default=len(sizes))
    return {
        "trained": trained,
        "train_bytes": (16 * trained + frozen) / 2,
        "first_sync": sum(sizes),
        "later_sync": sum(sizes[:first_frozen]),
    }


def vla(preset: str) -> None:
    """The --vla tables (the module docstring says what they measure)."""
    mib = 2**20
    work = Path(tempfile.mkdtemp(prefix="spmd_vla_"))
    folder = work / "model"
    parameters = _vla_folder(preset, folder)
    load_s, load_cpu_s = _load_once_s(folder)
    load = f"{os.getloadavg()[0]:.1f}"
    vla = ["policy.class=vla", f"policy.pretrained={folder}"]
    runs = {
        "mlp [16, 16]": _split_run(["policy.hidden_sizes=[16,16]"], work / "mlp"),
        "vla": _split_run(vla, work / "vla"),
        "vla, lora 16": _split_run([*vla, "policy.lora.rank=16"], work / "vla_lora"),
    }
    load += f"-{os.getloadavg()[0]:.1f}"
    full, lora = _vla_paper(folder, 0), _vla_paper(folder, 16)
    shutil.rmtree(work, ignore_errors=True)
    print(
        f"\nvla preset {preset} ({parameters / 1e6:.0f}M backbone parameters), split 5 (2 env, 1 inference, 2 fsdp "
        f"trainers), 2 iterations; one process importing, building and loading it: {load_s:.1f} s "
        f"({load_cpu_s:.1f} CPU s); load {load}"
    )
    roles = ("env", "inference", "trainer")
    rows, env_rss = [], {}
    for name, (startup_s, iteration_0_s, rank_cpu_s, ranks) in runs.items():
        rss = {role: [r["peak_rss_mb"] for r in ranks if r["role"] == role] for role in roles}
        builds = {role: [r["policy_builds"] for r in ranks if r["role"] == role] for role in roles}
        env_rss[name] = max(rss["env"])
        rows.append(
            [
                name,
                f"{startup_s:.1f}",
                f"{startup_s / load_s:.2f}x",
                f"{startup_s - iteration_0_s:.1f}",
                f"{(startup_s - iteration_0_s) / load_s:.2f}x",
                f"{rank_cpu_s:.1f} s = {rank_cpu_s / load_cpu_s:.2f}x",
                *(" / ".join(f"{mb:.0f}" for mb in rss[role]) for role in roles),  # each rank's, in rank order
                ", ".join(f"{role} {builds[role]}" for role in roles),
            ]
        )
    columns = ["policy", "to the first line s", "/ load once", "before iteration 0 s", "/ load once"]
    columns.append("busiest rank's CPU before iteration 0 / load once's")  # a rank per core: the start-up's floor
    print(table([*columns, *(f"{r} peak RSS MiB" for r in roles), "policy builds"], rows))
    print(f"env rank peak RSS, vla / mlp: {env_rss['vla'] / env_rss['mlp [16, 16]']:.2f}x")
    print("\nTraining state per fsdp trainer (of 2) and bytes per weight sync, on the policy built on the meta device:")
    print(
        table(
            ["policy", "trained parameters", "training state MiB", "first sync MiB", "later sync MiB"],
            [
                [
                    name,
                    f"{r['trained']:,}",
                    f"{r['train_bytes'] / mib:.0f}",
                    f"{r['first_sync'] / mib:.0f}",
                    f"{r['later_sync'] / mib:.1f}",
                ]  # fmt: skip
                for name, r in (("full", full), ("lora 16", lora))
            ],
        )
    )
    print(
        f"lora 16 / full: training state {lora['train_bytes'] / full['train_bytes']:.3f}x, bytes per later sync "
        f"{lora['later_sync'] / full['later_sync']:.4f}x"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[100, 300], help="millions of parameters")
    parser.add_argument("--designs", nargs="+", default=["sent"], choices=["gathered", "sent", "replicated"])
    parser.add_argument("--pairs", type=int, default=PAIRS, help="rounds of a sync and a raw broadcast")
    parser.add_argument(
        "--bucket-mb", type=int, default=BUCKET_MB, help="weights.bucket_mb of the syncs (smaller: more buckets)"
    )
    parser.add_argument("--vla", choices=["tiny", "small"], help="measure the vla policy of this preset instead")
    args = parser.parse_args()
    print(machine())
    print(f"load average before: {os.getloadavg()}")
    if args.vla:
        vla(args.vla)
        return
    mib = 2**20
    memory, syncs, paper = [], [], []
    for millions in args.sizes:
        layers = max(1, round(millions * 1e6 / (WIDTH * WIDTH + WIDTH)))
        ddp = measure(layers, "ddp", "fp32")
        results = {
            (wire, design): measure(layers, "fsdp", wire, design=design, pairs=args.pairs, bucket_mb=args.bucket_mb)
            for wire in ("fp32", "bf16")
            for design in args.designs
        }
        fsdp = results["fp32", next((d for d in args.designs if d != "replicated"), args.designs[0])]
        memory.append(
            [
                f"{ddp['parameters'] / 1e6:.0f}M",
                f"{ddp['train_bytes'] / mib:.0f}",
                f"{fsdp['train_bytes'] / mib:.0f}",
                f"{fsdp['train_bytes'] / ddp['train_bytes']:.2f}x",
            ]
        )
        for (wire, design), r in results.items():
            wire_ratio = r["all_bytes"] / results["fp32", design]["all_bytes"]
            low, high = r["ratio_low_high"]
            syncs.append(
                [
                    f"{ddp['parameters'] / 1e6:.0f}M",
                    wire,
                    design,
                    f"{r['all_bytes'] / mib:.0f} ({wire_ratio:.2f}x)",
                    f"{r['sync_s']:.2f}",
                    f"{r['raw_broadcast_s']:.2f}",
                    f"{r['ratio']:.2f}x ({low:.2f}-{high:.2f})",
                    f"{r['cpu_ratio']:.2f}x",
                    f"{r['sync_peak_extra_bytes'] / mib:.0f}",
                    f"{r['bucket_bytes'] / mib:.0f}",
                    f"{r['sync_peak_extra_bytes'] / r['bucket_bytes']:.2f}x",
                    r["load"],
                ]
            )
            if wire != "bf16":
                continue
            # The software overhead per bucket: what a sync takes beyond a raw broadcast of the same bytes
            # (median over the rounds), per bucket of this size; a 7B bf16 policy is that many buckets.
            overhead = r["overhead_s"] / r["buckets_later"]
            low, high = (s / r["buckets_later"] for s in r["overhead_low_high"])
            buckets_7b = math.ceil(PAPER_PARAMETERS * 2 / r["bucket_bytes"])
            wire_s = PAPER_PARAMETERS * 2 / PAPER_LINK_BYTES_S
            paper.append(
                [
                    f"{ddp['parameters'] / 1e6:.0f}M",
                    design,
                    f"{overhead * 1e3:.1f} ({low * 1e3:.1f} to {high * 1e3:.1f})",
                    f"{r['cpu_overhead_s'] / r['buckets_later'] * 1e3:.1f}",
                    str(buckets_7b),
                    f"{wire_s:.2f}",
                    f"{wire_s + buckets_7b * max(0.0, overhead):.2f}",
                    r["load"],
                ]
            )
    # A frozen backbone: 3/4 of the layers frozen; a sync after the first sends only the trainable rest.
    layers = max(4, round(args.sizes[0] * 1e6 / (WIDTH * WIDTH + WIDTH)))
    frozen = measure(layers, "fsdp", "fp32", frozen=3 * layers // 4, design=args.designs[-1], pairs=1)
    print("\nTrainer memory per rank (parameters + gradients + Adam state), 2 trainers:")
    print(table(["parameters", "ddp MiB", "fsdp MiB", "fsdp / ddp"], memory))
    print(
        f"\nWeight sync, 2 trainers (FSDP, but design replicated) -> 2 inference ranks, {args.bucket_mb} MiB buckets; "
        f"times from the first rank's start to the last rank's end, medians of {args.pairs} alternating rounds; "
        f"raw / sync: the median of the rounds' ratios (lowest-highest):"
    )
    print(
        table(
            [
                "parameters",
                "wire",
                "design",
                "MiB per sync",
                "sync s",
                "raw broadcast s",
                "raw / sync",
                "CPU s raw / sync",
                "peak extra MiB",
                "largest bucket MiB",
                "peak extra / bucket",
                "load",
            ],
            syncs,
        )
    )
    print(f"\nFrozen backbone ({3 * layers // 4} of {layers} layers frozen, design {args.designs[-1]}):")
    print(
        table(
            ["first sync MiB", "later sync MiB", "trainable MiB", "later / trainable"],
            [
                [
                    f"{frozen['all_bytes'] / mib:.0f}",
                    f"{frozen['later_sync_bytes'] / mib:.0f}",
                    f"{frozen['trainable_wire_bytes'] / mib:.0f}",
                    f"{frozen['later_sync_bytes'] / frozen['trainable_wire_bytes']:.3f}x",
                ]
            ],
        )
    )
    print(
        f"\nOn paper: a {PAPER_PARAMETERS / 1e9:.0f}B bf16 policy over a {PAPER_LINK_BYTES_S / 1e9:.0f} GB/s link, "
        f"plus the software overhead per bucket measured here with a bf16 wire (CPU processes over gloo; a GPU's "
        f"over NCCL is not measured; a negative overhead counts as 0). Overhead: the median over the rounds of (sync - "
        f"raw) / buckets, lowest to highest round beside it; CPU: the same in CPU seconds of the four ranks:"
    )
    headers = ["measured at", "design", "overhead ms per bucket", "CPU ms per bucket", "buckets", "wire s", "7B sync s"]
    print(table([*headers, "load"], paper))
    print(f"\nload average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
