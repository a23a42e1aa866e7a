"""Regression harness: run a fixed set of small, seeded runs from one checkout of spmd_rl and compare two such sets
line for line (metrics.jsonl without its timing keys) and byte for byte (policy.pt), to show that a change such as
a package-layout refactor changes no behaviour.

    # before the change: a worktree of the old commit
    git worktree add --detach /tmp/base HEAD
    python benchmarks/regression.py --tree /tmp/base --out /tmp/regress_before
    # after the change: this checkout, compared with the baseline
    python benchmarks/regression.py --out /tmp/regress_after --compare /tmp/regress_before
    # compare two existing outputs only
    python benchmarks/regression.py --out /tmp/regress_after --compare /tmp/regress_before --no-run

Every case runs `python -m spmd_rl.main` (under the venv's torchrun --standalone when it has several ranks) with
cwd=<tree> and PYTHONPATH=<tree>, so spmd_rl is imported from the tree and not from the installed (editable) copy;
a preflight checks that. Each case writes its run to <out>/<case> (run.dir) and its output to <out>/<case>.log;
<out>/manifest.json records the tree, its commit, the commands and their durations.

What is compared, per case: the number of metrics.jsonl lines, each line's keys but the timing keys (a change may
add timings: those are noted), each line's values except the timing keys (names starting with `time_`, containing
`sps`, or ending in `_s`: wall_s, cpu_s, time_env_s, ...), policy.pt's sha256 (and, when it differs, whether the
tensors are equal), config.yaml (the resolved config, but run.dir), and for HDF5 runs the contents of buffer/*.h5
(every dataset's bytes and the file attributes except writer_pid/writer_host). Cases marked
timing-dependent (the async engine with max_policy_lag > 0) report their differences without failing; their
line count and keys must still match. Exit code 0 when nothing that counts differs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TINY = "configs/ci_tiny.yaml"
SPLIT4 = ["layout.mode=split", "layout.trainer=1", "layout.inference=1", "layout.env=2"]
COMMON = ["train.seed=1", "log.progress=false", "log.tensorboard=false"]
SAC_SHORT = ["train.total_steps=800", "algo.learning_starts=256"]

# name: (config, overrides, ranks (0: one process, no launcher), timing-dependent)
CASES: dict[str, tuple[str, list[str], int, bool]] = {
    "tiny-1proc": (TINY, [], 0, False),
    "tiny-colocated2": (TINY, ["train.total_steps=512"], 2, False),
    "tiny-split4": (TINY, ["train.total_steps=512", *SPLIT4], 4, False),
    "ppo-pendulum-normobs": (
        "configs/ppo_pendulum.yaml",
        ["policy.normalize_obs=true", "algo.num_steps=128", "algo.num_minibatches=8", "train.total_steps=2048"],
        0,
        False,
    ),
    "sac-pendulum-memory": ("configs/sac_pendulum.yaml", [*SAC_SHORT, "buffer.backend=memory"], 0, False),
    "sac-pendulum-hdf5-log": (
        "configs/sac_pendulum.yaml",
        [*SAC_SHORT, "buffer.backend=hdf5", "buffer.log_experience=true"],
        0,
        False,
    ),
    "sac-split4-hdf5-log": (
        "configs/sac_pendulum.yaml",
        [*SAC_SHORT, *SPLIT4, "buffer.backend=hdf5", "buffer.log_experience=true"],
        4,
        False,
    ),
    "async-lag0-split4": (
        TINY,
        ["train.total_steps=512", *SPLIT4, "engine.class=async", "engine.max_policy_lag=0"],
        4,
        False,
    ),
    "async-lag2-vtrace-split4": (
        TINY,
        ["train.total_steps=512", *SPLIT4, "engine.class=async", "engine.max_policy_lag=2", "algo.vtrace=true"],
        4,
        True,
    ),
}

# Variables that would make spmd_rl.launch detect a launcher that is not there.
LAUNCHER_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GROUP_RANK",
    "TORCHELASTIC_RUN_ID",
)
LAUNCHER_PREFIXES = ("SLURM_", "OMPI_", "PMIX_", "PMI_", "TORCHELASTIC_")
IGNORED_H5_ATTRS = ("writer_pid", "writer_host")


def is_timing_key(key: str) -> bool:
    return key.startswith("time_") or "sps" in key or key.endswith("_s")


def child_env(tree: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS and not k.startswith(LAUNCHER_PREFIXES)}
    env.update(PYTHONPATH=str(tree), GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


def command(tree: Path, out: Path, case: str) -> list[str]:
    config, overrides, nproc, _ = CASES[case]
    # config relative to cwd=<tree>: the command lines of two trees differ only in run.dir
    args = ["-m", "spmd_rl.main", "--config", config, *overrides, *COMMON, f"run.dir={out / case}"]
    if not nproc:
        return [sys.executable, *args]
    torchrun = Path(sys.executable).parent / "torchrun"
    launcher = [str(torchrun)] if torchrun.exists() else [sys.executable, "-m", "torch.distributed.run"]
    return [*launcher, "--standalone", f"--nproc_per_node={nproc}", *args]


def git(tree: Path, *args: str) -> str:
    result = subprocess.run(["git", "-C", str(tree), *args], capture_output=True, text=True)
    return result.stdout.strip() if result.returncode == 0 else "?"


def run_all(tree: Path, out: Path, cases: list[str], timeout: float) -> bool:
    env = child_env(tree)
    probe = subprocess.run(
        [sys.executable, "-c", "import spmd_rl; print(spmd_rl.__file__)"],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
    )
    imported = Path(probe.stdout.strip() or "?").resolve()
    if probe.returncode != 0 or tree not in imported.parents:
        sys.exit(f"regression: spmd_rl is imported from {imported}, not from {tree}:\n{probe.stderr[-2000:]}")
    print(
        f"tree {tree} (commit {git(tree, 'rev-parse', 'HEAD')[:12]}, "
        f"{len(git(tree, 'status', '--porcelain').splitlines())} changed files); spmd_rl from {imported}"
    )
    out.mkdir(parents=True, exist_ok=True)
    manifest = {
        "tree": str(tree),
        "commit": git(tree, "rev-parse", "HEAD"),
        "dirty_files": git(tree, "status", "--porcelain").splitlines(),
        "spmd_rl": str(imported),
        "python": sys.executable,
        "cases": {},
    }
    ok, start = True, time.monotonic()
    for case in cases:
        run_dir = out / case
        if run_dir.exists():
            shutil.rmtree(run_dir)  # a finished run in run.dir would be refused
        cmd = command(tree, out, case)
        print(f"[{case}] {' '.join(cmd)}", flush=True)
        t0 = time.monotonic()
        try:
            result = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
            rc, stdout, stderr = result.returncode, result.stdout, result.stderr
        except subprocess.TimeoutExpired as e:
            rc, stdout, stderr = "timeout", str(e.stdout or ""), str(e.stderr or "")
        seconds = time.monotonic() - t0
        (out / f"{case}.log").write_text(
            f"$ {' '.join(cmd)}\n# rc {rc}, {seconds:.1f}s\n--- stdout\n{stdout}--- stderr\n{stderr}"
        )
        print(f"[{case}] rc {rc}, {seconds:.1f}s", flush=True)
        if rc != 0:
            ok = False
            print(f"[{case}] FAILED; last stderr:\n{stderr[-2000:]}", flush=True)
        manifest["cases"][case] = {
            "command": cmd,
            "rc": rc,
            "seconds": round(seconds, 2),
            "timing_dependent": CASES[case][3],
        }
    manifest["seconds"] = round(time.monotonic() - start, 2)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"ran {len(cases)} cases in {manifest['seconds']:.0f}s into {out}")
    return ok


# ---------------------------------------------------------------------------------------------------------------
# Comparison


def read_records(run_dir: Path) -> list[dict] | None:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return None
    return [json.loads(line) for line in path.read_text().splitlines()]


def sha256(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


def same_tensors(a: Path, b: Path) -> bool:
    import torch

    sa, sb = torch.load(a, weights_only=True), torch.load(b, weights_only=True)

    def same(x, y) -> bool:
        if torch.is_tensor(x) or torch.is_tensor(y):
            return (
                torch.is_tensor(x)
                and torch.is_tensor(y)
                and x.dtype == y.dtype
                and x.shape == y.shape
                and torch.equal(x, y)
            )
        return x == y

    return sa.keys() == sb.keys() and all(same(sa[k], sb[k]) for k in sa)


def resolved_config(run_dir: Path) -> dict | None:
    """config.yaml flattened to dotted keys, without run.dir (it names the output directory)."""
    import yaml

    path = run_dir / "config.yaml"
    if not path.is_file():
        return None
    flat: dict = {}

    def walk(prefix: str, node) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(f"{prefix}{k}.", v)
        else:
            flat[prefix[:-1]] = node

    walk("", yaml.safe_load(path.read_text()))
    flat.pop("run.dir", None)
    return flat


def h5_digest(path: Path) -> dict:
    """Dataset name -> (shape, dtype, sha256 of bytes); plus the file attributes that do not name the writer."""
    import h5py
    import numpy as np

    digest: dict = {}
    with h5py.File(path, "r") as f:
        digest["@attrs"] = {k: repr(v) for k, v in f.attrs.items() if k not in IGNORED_H5_ATTRS}

        def visit(name, obj):
            if isinstance(obj, h5py.Dataset):
                data = np.ascontiguousarray(obj[()])
                digest[name] = (
                    obj.shape,
                    str(obj.dtype),
                    hashlib.sha256(data.tobytes()).hexdigest(),
                    {k: repr(v) for k, v in obj.attrs.items()},
                )

        f.visititems(visit)
    return digest


def compare_case(a: Path, b: Path, case: str, timing_dependent: bool, ignored: set) -> dict:
    """One case's verdict: {'lines', 'metrics', 'policy', 'buffer', 'notes', 'fail'}."""
    notes, fail = [], False
    ra, rb = read_records(a / case), read_records(b / case)
    if ra is None or rb is None:
        return {
            "lines": "-",
            "metrics": "MISSING",
            "policy": "-",
            "config": "-",
            "buffer": "-",
            "fail": True,
            "notes": [f"metrics.jsonl missing in {a / case if ra is None else b / case}"],
        }
    lines = f"{len(ra)}" if len(ra) == len(rb) else f"{len(ra)} vs {len(rb)}"
    structural = len(ra) != len(rb)
    differing_lines, differing_keys = 0, set()
    for i, (x, y) in enumerate(zip(ra, rb)):
        ignored.update(k for k in (*x, *y) if is_timing_key(k))
        new_timings = sorted(k for k in x.keys() ^ y.keys() if is_timing_key(k))
        if new_timings and i == 0:  # a change may add timings (their values are never compared)
            notes.append(f"timing keys in one side only (not compared): {new_timings}")
        if {k for k in x if not is_timing_key(k)} != {k for k in y if not is_timing_key(k)}:
            structural = True
            notes.append(
                f"line {i}: keys differ: only in this: {sorted(x.keys() - y.keys())}, "
                f"only in other: {sorted(y.keys() - x.keys())}"
            )
        keys = [k for k in x.keys() & y.keys() if not is_timing_key(k) and x[k] != y[k]]
        if keys:
            differing_lines += 1
            differing_keys.update(keys)
            if differing_lines == 1:
                notes.append(
                    f"first differing line {i}: " + ", ".join(f"{k}: {x[k]!r} vs {y[k]!r}" for k in sorted(keys)[:4])
                )
    if structural:
        metrics, fail = "NO (lines/keys)", True
    elif differing_lines:
        metrics = f"no ({differing_lines}/{len(ra)} lines)"
        notes.append(f"differing keys: {sorted(differing_keys)}")
        fail = fail or not timing_dependent
    else:
        metrics = "yes"

    ha, hb = sha256(a / case / "policy.pt"), sha256(b / case / "policy.pt")
    if ha is None or hb is None:
        policy, fail = "MISSING", True
    elif ha == hb:
        policy = "yes"
    else:
        policy = "no (tensors equal)" if same_tensors(a / case / "policy.pt", b / case / "policy.pt") else "no"
        fail = fail or not timing_dependent

    ca, cb = resolved_config(a / case), resolved_config(b / case)
    if ca is None or cb is None:
        config, fail = "MISSING", True
    elif ca == cb:
        config = "yes"
    else:
        config, fail = "NO", True
        notes.append(
            "config.yaml differs: "
            + ", ".join(
                f"{k}: {ca.get(k)!r} vs {cb.get(k)!r}" for k in sorted(ca.keys() | cb.keys()) if ca.get(k) != cb.get(k)
            )
        )

    files_a = sorted(p.name for p in (a / case / "buffer").glob("*.h5"))
    files_b = sorted(p.name for p in (b / case / "buffer").glob("*.h5"))
    if not files_a and not files_b:
        buffer = "-"
    elif files_a != files_b:
        buffer, fail = "NO (files)", True
        notes.append(f"buffer files {files_a} vs {files_b}")
    else:
        bad = [n for n in files_a if h5_digest(a / case / "buffer" / n) != h5_digest(b / case / "buffer" / n)]
        buffer = "yes" if not bad else f"no ({', '.join(bad)})"
        if bad:
            fail = fail or not timing_dependent
    if timing_dependent and (differing_lines or buffer.startswith("no") or policy.startswith("no")):
        notes.append("timing-dependent case: differences reported, not counted")
    return {
        "lines": lines,
        "metrics": metrics,
        "policy": policy,
        "config": config,
        "buffer": buffer,
        "notes": notes,
        "fail": fail,
    }


def compare(a: Path, b: Path, cases: list[str]) -> bool:
    manifest_a = json.loads((a / "manifest.json").read_text()) if (a / "manifest.json").is_file() else {}
    manifest_b = json.loads((b / "manifest.json").read_text()) if (b / "manifest.json").is_file() else {}
    print(
        f"\ncompare {a} ({manifest_a.get('commit', '?')[:12]}, tree {manifest_a.get('tree', '?')})\n"
        f"   with {b} ({manifest_b.get('commit', '?')[:12]}, tree {manifest_b.get('tree', '?')})"
    )
    ignored: set = set()
    rows, all_notes, ok = [], [], True
    for case in cases:
        verdict = compare_case(a, b, case, CASES[case][3], ignored)
        ok = ok and not verdict["fail"]
        rows.append(
            [
                case + (" (timing-dependent)" if CASES[case][3] else ""),
                verdict["lines"],
                verdict["metrics"],
                verdict["policy"],
                verdict["config"],
                verdict["buffer"],
                "FAIL" if verdict["fail"] else "ok",
            ]
        )
        all_notes += [f"  {case}: {n}" for n in verdict["notes"]]
    print(
        table(
            [
                "case",
                "lines",
                "metrics identical?",
                "policy.pt identical?",
                "config.yaml same?",
                "buffer/*.h5 identical?",
                "verdict",
            ],
            rows,
        )
    )
    print(f"timing keys ignored: {', '.join(sorted(ignored)) or '(none)'}")
    if all_notes:
        print("notes:\n" + "\n".join(all_notes))
    print("RESULT: " + ("identical (timing-dependent cases aside)" if ok else "DIFFERENCES"))
    return ok


def table(headers: list[str], rows: list[list]) -> str:
    cells = [[str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    line = lambda values: "| " + " | ".join(v.ljust(w) for v, w in zip(values, widths)) + " |"  # noqa: E731
    return "\n".join([line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, cells)])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", type=Path, default=REPO, help="checkout of spmd_rl to run (default: %(default)s)")
    parser.add_argument("--out", type=Path, required=True, help="where the runs go (one directory per case)")
    parser.add_argument("--compare", type=Path, metavar="OTHER_OUT", help="compare --out with this output")
    parser.add_argument("--no-run", action="store_true", help="only compare --out with --compare")
    parser.add_argument(
        "--cases", nargs="+", choices=list(CASES), default=list(CASES), help="a subset to run and compare"
    )
    parser.add_argument("--timeout", type=float, default=300, help="seconds per case")
    args = parser.parse_args()
    out = args.out.resolve()
    ok = True
    if not args.no_run:
        ok = run_all(args.tree.resolve(), out, args.cases, args.timeout)
    elif args.compare is None:
        parser.error("--no-run needs --compare")
    if args.compare is not None:
        ok = compare(out, args.compare.resolve(), args.cases) and ok
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
