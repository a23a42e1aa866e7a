"""HDF5 storage benchmark: append throughput, replay sampling throughput, resident memory of a disk-backed buffer,
and the cost of the time bound on unwritten rows (buffer.flush_every_s).

    python benchmarks/storage.py [--rows 2000000] [--big-rows 10000000] [--dir /tmp]
    python benchmarks/storage.py --only time-bound      # just the flush_every_s table (~1 min)
    python benchmarks/storage.py --only checksums       # with and without the fletcher32 checksums (~3 min)

Transitions of a 17-dim observation (HalfCheetah-like): obs and next_obs float32[17], action float32[6], reward
float32, terminated bool, 165 bytes a row. Baselines are measured in the same run: raw h5py writing the same arrays
as whole chunks (no staging, no flushes), and the in-memory replay buffer for sampling.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import shutil
import tempfile
import time
from pathlib import Path

import h5py
import numpy as np
import torch
from tensordict import TensorDict

from spmd_rl import data as data_tool
from spmd_rl.storage.reader import HDF5Reader
from spmd_rl.storage.replay import ReplayBuffer
from spmd_rl.storage.writer import HDF5Writer

OBS_DIM, ACTION_DIM = 17, 6
CHUNK_ROWS = 4096  # what default_chunk_rows picks for these 165-byte rows
SAMPLE_BATCH = 256


def transitions(rows: int, seed: int = 0) -> TensorDict:
    g = torch.Generator().manual_seed(seed)
    return TensorDict(
        {
            "obs": torch.randn(rows, OBS_DIM, generator=g),
            "action": torch.randn(rows, ACTION_DIM, generator=g),
            "reward": torch.randn(rows, generator=g),
            "next": {
                "obs": torch.randn(rows, OBS_DIM, generator=g),
                "terminated": torch.rand(rows, generator=g) < 0.01,
            },
        },
        batch_size=[rows],
    )


def row_bytes(td: TensorDict) -> int:
    return sum(v[0].numel() * v.element_size() for v in td.values(include_nested=True, leaves_only=True))


def rss_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def raw_h5py_append(path: str, td: TensorDict) -> float:
    """Seconds to write td's columns as whole chunks with plain h5py (resize + write per chunk, one close)."""
    columns = {
        "/".join(k) if isinstance(k, tuple) else k: v.numpy()
        for k, v in td.items(include_nested=True, leaves_only=True)
    }
    # The same metadata columns the writer stores, so both write the same bytes.
    columns.update(
        {f"meta/{name}": np.arange(len(td), dtype=np.int64) for name in ("policy_version", "env_id", "env_step")}
    )
    rows = len(td)
    start = time.perf_counter()
    with h5py.File(path, "w", libver="latest") as file:
        datasets = {
            key: file.create_dataset(
                key,
                shape=(0, *a.shape[1:]),
                maxshape=(None, *a.shape[1:]),
                chunks=(CHUNK_ROWS, *a.shape[1:]),
                dtype=a.dtype,
            )
            for key, a in columns.items()
        }
        for first in range(0, rows, CHUNK_ROWS):
            last = min(rows, first + CHUNK_ROWS)
            for key, dataset in datasets.items():
                dataset.resize(last, axis=0)
                dataset[first:last] = columns[key][first:last]
    return time.perf_counter() - start


def writer_append(path: str, td: TensorDict, batch_rows: int) -> float:
    """Seconds for HDF5Writer to take td in appends of batch_rows rows (plus metadata), flushed and closed."""
    batches = [td[first : first + batch_rows] for first in range(0, len(td), batch_rows)]  # as a trainer has them
    start = time.perf_counter()
    with HDF5Writer(path, td[:1], chunk_rows=CHUNK_ROWS, overwrite=True) as writer:
        for step, batch in enumerate(batches):
            writer.append(batch, policy_version=1, env_id=0, env_step=step * batch_rows)
    return time.perf_counter() - start


def paced_append(
    path: str, td: TensorDict, batch_rows: int, rows_per_s: float, seconds: float, flush_every_s: float
) -> tuple[float, int]:
    """Append batch_rows-row slices of td at rows_per_s (as a trainer does between its learning steps) for `seconds`;
    return the seconds spent inside append and close (the writer's cost) and the rows appended."""
    batches = [td[first : first + batch_rows] for first in range(0, len(td) - batch_rows + 1, batch_rows)]
    inside, rows = 0.0, 0
    with HDF5Writer(path, td[:1], chunk_rows=CHUNK_ROWS, overwrite=True, flush_every_s=flush_every_s) as writer:
        start = time.perf_counter()
        for step in range(int(seconds * rows_per_s / batch_rows)):
            due = start + step * batch_rows / rows_per_s
            while (now := time.perf_counter()) < due:
                time.sleep(min(due - now, 0.001))
            writer.append(batches[step % len(batches)], policy_version=1, env_id=0, env_step=rows)
            inside += time.perf_counter() - now
            rows += batch_rows
        now = time.perf_counter()
    return inside + time.perf_counter() - now, rows


def time_bound_table(work: str, repeats: int) -> list[tuple[str, str, str, str]]:
    """The writer's cost per row with a time bound on unwritten rows, against no bound (inf), in the same run."""
    td = transitions(1 << 16, seed=2)
    with HDF5Writer(f"{work}/paced.h5", td[:1], chunk_rows=CHUNK_ROWS, overwrite=True) as writer:
        stage_rows = writer.stage_rows  # a full stage is written whatever the bound
    table = []
    bounds = (math.inf, 2.0, 0.5, 0.1, 0.0)
    for rows_per_s, seconds in ((10_000, 4.0), (100_000, 2.0)):
        best = {bound: math.inf for bound in bounds}
        for _ in range(repeats):  # interleaved, best of each: the machine is shared
            for bound in bounds:
                inside, rows = paced_append(f"{work}/paced.h5", td, 256, rows_per_s, seconds, bound)
                best[bound] = min(best[bound], inside / rows)
        for bound in bounds:
            unwritten = min(stage_rows, max(bound * rows_per_s, 256))  # rows a kill -9 can lose, at most
            table.append(
                (
                    f"append 256 rows at {rows_per_s:,} rows/s, flush_every_s={bound:g}",
                    f"{best[bound] * 1e6:.2f} us/row",
                    f"{best[bound] / best[math.inf]:.2f}",
                    f"unwritten at most {unwritten:,.0f} rows ({unwritten / rows_per_s:.2f} s)"
                    + (", baseline: whole stages only" if bound == math.inf else ""),
                )
            )
    return table


@contextlib.contextmanager
def fletcher32(on: bool):
    """Files written meanwhile have the checksums (as spmd_rl writes them) or not (as before issue 19)."""
    if on:
        yield
        return
    original = h5py.Group.create_dataset

    def without(self, name, *args, **kwargs):
        kwargs.pop("fletcher32", None)
        if name == "cursor":
            kwargs.pop("chunks", None)  # contiguous, as before
        return original(self, name, *args, **kwargs)

    h5py.Group.create_dataset = without
    try:
        yield
    finally:
        h5py.Group.create_dataset = original


def checksum_table(work: str, rows: int, repeats: int) -> list[tuple[str, str, str, str]]:
    """Write, read, inspect, sample and resume (open + rewind, which verifies every row) without and with the
    fletcher32 checksums, interleaved in one run, best of `repeats`; ratio = with / without, in throughput."""
    td = transitions(rows, seed=3)
    mb = rows * row_bytes(td) / 1e6
    measures = {
        "append 256-row batches (staged, whole chunks)": (mb, lambda on: writer_append(f"{work}/c{on}.h5", td, 256)),
        "append 256-row batches, flush_every_s=0 (a partial chunk per append)": (
            mb / 8,
            lambda on: _flush_every_append(f"{work}/p{on}.h5", td[: rows // 8]),
        ),
        "read every row (HDF5Reader.read)": (mb, lambda on: _timed(lambda: _read_all(f"{work}/c{on}.h5"))),
        "data inspect (checks every row)": (
            mb,
            lambda on: _timed(lambda: data_tool.summarize(Path(f"{work}/c{on}.h5"))),
        ),
    }
    for n in (100_000, 1_000_000):
        if n <= rows:
            measures[f"resume: open + rewind of a {n:,}-row replay file"] = (
                n * row_bytes(td) / 1e6,
                lambda on, n=n: _resume(f"{work}/r{n}-{on}.h5", td[:n]),
            )
    best = {(name, on): math.inf for name in measures for on in (False, True)}
    sample = {False: 0.0, True: 0.0}
    for _ in range(repeats):  # interleaved, best of each: the machine is shared
        for on in (False, True):
            with fletcher32(on):
                for name, (_, measure) in measures.items():
                    best[name, on] = min(best[name, on], measure(on))
                replay = ReplayBuffer(
                    rows, td[:1], backend="hdf5", path=f"{work}/s{on}.h5", chunk_rows=CHUNK_ROWS, flush_every_s=0
                )
                replay.add(td)
                sample[on] = max(sample[on], sample_rate(replay))
                replay.close()
                os.remove(f"{work}/s{on}.h5")
    table = []
    for name, (volume, _) in measures.items():
        off, on = best[name, False], best[name, True]
        table.append(
            (
                f"{name}, {rows:,} rows" if "resume" not in name else name,
                f"{volume / off:,.0f} -> {volume / on:,.0f} MB/s",
                f"{off / on:.2f}",
                f"{off * 1e3:,.0f} -> {on * 1e3:,.0f} ms",
            )
        )
    table.append(
        (
            f"sample {SAMPLE_BATCH} (direct reads), HDF5 buffer, {rows:,} rows",
            f"{sample[False]:,.0f} -> {sample[True]:,.0f} rows/s",
            f"{sample[True] / sample[False]:.2f}",
            "",
        )
    )
    return table


def _timed(call) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def _read_all(path: str) -> None:
    with HDF5Reader(path) as reader:
        reader.read(meta=True)


def _flush_every_append(path: str, td: TensorDict) -> float:
    start = time.perf_counter()
    with HDF5Writer(path, td[:1], chunk_rows=CHUNK_ROWS, overwrite=True, flush_every_s=0) as writer:
        for first in range(0, len(td), 256):
            writer.append(td[first : first + 256], policy_version=1, env_id=0, env_step=first)
    return time.perf_counter() - start


def _resume(path: str, td: TensorDict) -> float:
    """Seconds to reopen a full replay file of len(td) rows and rewind it to its cursor, as a resume does (the
    file was just written: in the page cache)."""
    if not os.path.exists(path):
        replay = ReplayBuffer(len(td), td[:1], backend="hdf5", path=path, chunk_rows=CHUNK_ROWS)
        replay.add(td)
        replay.close()
    start = time.perf_counter()
    replay = ReplayBuffer(len(td), td[:1], backend="hdf5", path=path)
    replay.rewind(len(td))
    elapsed = time.perf_counter() - start
    replay.close()
    return elapsed


def sample_rate(buffer: ReplayBuffer, seconds: float = 2.0) -> float:
    generator = torch.Generator().manual_seed(0)
    buffer.sample(SAMPLE_BATCH, generator)  # warm-up
    batches, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        buffer.sample(SAMPLE_BATCH, generator)
        batches += 1
    return batches * SAMPLE_BATCH / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2_000_000, help="rows for the append and sampling tests")
    parser.add_argument("--big-rows", type=int, default=10_000_000, help="rows of the disk-backed buffer (RSS)")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where the benchmark's files go")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats of the append tests")
    parser.add_argument("--only", choices=["time-bound", "checksums"], help="run only this part")
    args = parser.parse_args()
    torch.set_num_threads(1)
    work = tempfile.mkdtemp(prefix="spmd_rl_storage_bench_", dir=args.dir)
    table: list[tuple[str, str, str, str]] = []
    try:
        if args.only == "checksums":
            print_table(checksum_table(work, min(args.rows, 1_000_000), args.repeats))
            return
        table += time_bound_table(work, args.repeats)
        if args.only == "time-bound":
            print_table(table)
            return
        td = transitions(args.rows)
        mb = args.rows * row_bytes(td) / 1e6
        # Interleaved repeats, best of each: the machine is shared, so a single run is mostly noise.
        runs = {"raw": lambda td=td: raw_h5py_append(f"{work}/raw.h5", td)}
        runs.update(
            {
                rows: (lambda rows=rows, td=td: writer_append(f"{work}/writer.h5", td, rows))
                for rows in (256, CHUNK_ROWS * 4)
            }
        )
        best = {name: float("inf") for name in runs}
        for _ in range(args.repeats):
            for name, run in runs.items():
                best[name] = min(best[name], run())
        table.append(
            (
                "append, raw h5py whole chunks (baseline)",
                f"{mb / best['raw']:.0f} MB/s",
                "1.00",
                f"best of {args.repeats}; MB/s of transition data, both also write 3 int64 metadata columns",
            )
        )
        for rows in (256, CHUNK_ROWS * 4):
            table.append(
                (
                    f"append, HDF5Writer, {rows}-row appends + metadata",
                    f"{mb / best[rows]:.0f} MB/s",
                    f"{best['raw'] / best[rows]:.2f}",
                    "goal >= 0.8",
                )
            )

        memory = ReplayBuffer(args.rows, td[:1])
        memory.add(td)
        memory_rate = sample_rate(memory)
        table.append(
            (
                f"sample {SAMPLE_BATCH}, memory buffer, {args.rows:,} rows (baseline)",
                f"{memory_rate:,.0f} rows/s",
                "1.00",
                "",
            )
        )
        del memory
        disk = ReplayBuffer(args.rows, td[:1], backend="hdf5", path=f"{work}/replay.h5", chunk_rows=CHUNK_ROWS)
        disk.add(td)
        rate = sample_rate(disk)
        table.append(
            (
                f"sample {SAMPLE_BATCH}, HDF5 buffer, {args.rows:,} rows",
                f"{rate:,.0f} rows/s",
                f"{rate / memory_rate:.2f}",
                "",
            )
        )
        disk.close()
        del td

        free_gb = shutil.disk_usage(work).free / 1e9
        big_gb = args.big_rows * 165 / 1e9
        if free_gb < 2 * big_gb:
            raise SystemExit(
                f"only {free_gb:.1f} GB free in {work}; the {args.big_rows:,}-row test needs {2 * big_gb:.1f} GB"
            )
        batch = transitions(CHUNK_ROWS * 4, seed=1)
        big = ReplayBuffer(args.big_rows, batch[:1], backend="hdf5", path=f"{work}/big.h5", chunk_rows=CHUNK_ROWS)
        rss_before = rss_mib()
        start = time.perf_counter()
        for _ in range(0, args.big_rows, len(batch)):
            big.add(batch)
        fill_s = time.perf_counter() - start
        rss_after = rss_mib()
        data_mib = args.big_rows * row_bytes(batch) / 2**20
        cold_rate = sample_rate(big)  # the rows just written are mostly not in the page cache: reads hit the disk
        rate = sample_rate(big, seconds=4.0)
        rss_sampled = rss_mib()
        big.close()
        disk_mib = os.path.getsize(f"{work}/big.h5") / 2**20
        table.append(
            (
                f"fill HDF5 buffer with {args.big_rows:,} rows",
                f"{data_mib / 1.048576 / fill_s:.0f} MB/s",
                "",
                f"{disk_mib:,.0f} MiB on disk",
            )
        )
        table.append(
            (
                "  RSS before fill / after fill / after sampling",
                f"{rss_before:,.0f} / {rss_after:,.0f} / {rss_sampled:,.0f} MiB",
                f"{(rss_sampled - rss_before) / data_mib:.3f}",
                f"growth / data size ({data_mib:,.0f} MiB)",
            )
        )
        table.append(
            (
                f"sample {SAMPLE_BATCH}, HDF5 buffer, {args.big_rows:,} rows, first 2 s",
                f"{cold_rate:,.0f} rows/s",
                f"{cold_rate / memory_rate:.2f}",
                "vs memory baseline above",
            )
        )
        table.append(
            (
                f"sample {SAMPLE_BATCH}, HDF5 buffer, {args.big_rows:,} rows, next 4 s",
                f"{rate:,.0f} rows/s",
                f"{rate / memory_rate:.2f}",
                "vs memory baseline above",
            )
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print_table(table)


def print_table(table: list[tuple[str, str, str, str]]) -> None:
    width = max(len(row[0]) for row in table)
    print(f"{'measure':<{width}}  {'value':>28}  {'ratio':>6}  note")
    for name, value, ratio, note in table:
        print(f"{name:<{width}}  {value:>28}  {ratio:>6}  {note}")


if __name__ == "__main__":
    main()
