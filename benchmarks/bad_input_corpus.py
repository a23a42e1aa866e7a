"""A generated corpus of bad inputs, run through the checks before start (config, plug-ins, layout, env, policy
contract, planned memory) in this process: every case must end in a UserError (one line, exit 2) or be accepted;
anything else is a traceback, and a case still running after --case-timeout-s is a hang.

    python benchmarks/bad_input_corpus.py [--limit N] [--case-timeout-s S] [--json OUT]

Cases: for every key of the default PPO config and of SAC's, a handful of wrong values (wrong types, negatives,
zero, huge numbers, NaN/inf, empty and nested containers, long and odd strings, YAML 1.1 forms), plus a few
plug-in and env names. Each case is one override given as on the command line, read with load_config and checked
with the driver's `resolve` (the same checks `python -m spmd_rl.main` makes before any process group exists).
Accepted cases are listed: a value that passes is not necessarily wrong (1e9 steps is a long run, not an error).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from spmd_rl.config.loading import load_config  # noqa: E402
from spmd_rl.runtime.errors import UserCodeError, UserError  # noqa: E402

BAD_VALUES = [
    "-1",
    "0",
    "1e400",
    "nan",
    "-inf",
    "'text'",
    "[]",
    "{}",
    "[[1]]",
    "{a: 1}",
    "064",
    "1:30",
    "off",
    "99999999999999999999",
    "x" * 300,
    "null",
]
PER_KEY = 3
NAMES = [
    "policy.class=nowhere:Net",
    "algo.class=ppo:PPO",
    "engine.class=os:system",
    "callbacks=[json:loads]",
    "env.id=NoSuchEnv-v0",
    "env.id=gymnasium:",
    "env.id=os:getcwd",
    "policy.class=builtins:object",
    "env.kwargs={max_episode_steps: 0}",
    "env.kwargs={max_episode_steps: -3}",
    "env.kwargs={render_mode: 7}",
    "env.kwargs={nonsense: 1}",
    "policy.hidden_sizes=[100000,100000]",
    "algo.num_minibatches=1000000",
    "layout.mode=split",
    "env.total_envs=7",
    "eval.episodes=1000000000",
    "eval.env={id: Pendulum-v1}",
]


def keys_of(overrides: list[str]) -> list[str]:
    cfg = load_config(None, overrides)
    out = []
    for section, values in cfg.to_dict().items():
        if isinstance(values, dict):
            out += [f"{section}.{key}" for key in values if key != "class"]
    return out


class _Hang(BaseException):
    pass


def _on_alarm(signum, frame):
    raise _Hang()


def run_case(base: list[str], item: str, timeout_s: int) -> tuple[str, str]:
    """(outcome, detail): refused (a UserError's line), accepted, traceback, or hang."""
    from spmd_rl.run.driver import resolve
    from spmd_rl.runtime.launch import LaunchInfo

    launch = LaunchInfo("none", rank=0, world_size=1, local_rank=0, local_world_size=1, init_method="")
    signal.signal(signal.SIGALRM, _on_alarm)
    signal.alarm(timeout_s)
    try:
        cfg = load_config(None, [*base, item])
        resolve(cfg, launch, dry_run=False)
        return "accepted", ""
    except (UserError, UserCodeError) as exc:
        text = str(exc)
        return ("refused", text.splitlines()[0][:200]) if "\n" not in text else ("traceback", "multi-line: " + text)
    except _Hang:
        return "hang", ""
    except BaseException:  # noqa: BLE001 - what the corpus is for
        return "traceback", traceback.format_exc(limit=3)[-400:]
    finally:
        signal.alarm(0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=0, help="run only the first N cases (0: all)")
    parser.add_argument("--case-timeout-s", type=int, default=60)
    parser.add_argument("--json", type=Path, help="write every case's outcome here")
    args = parser.parse_args()
    bases = {"ppo": ["env.num_envs=2", "algo.num_steps=8"], "sac": ["algo.class=sac", "env.id=Pendulum-v1"]}
    cases = [("ppo", item) for item in NAMES]
    for name, base in bases.items():
        # every key gets PER_KEY of the bad values, a different run of them key after key (all of them, in turn)
        cases += [
            (name, f"{key}={BAD_VALUES[(i * PER_KEY + j) % len(BAD_VALUES)]}")
            for i, key in enumerate(keys_of(base))
            for j in range(PER_KEY)
        ]
    if args.limit:
        cases = cases[: args.limit]
    counts: dict[str, int] = {}
    results = []
    started = time.monotonic()
    for name, item in cases:
        outcome, detail = run_case(bases[name], item, args.case_timeout_s)
        counts[outcome] = counts.get(outcome, 0) + 1
        results.append({"base": name, "override": item[:120], "outcome": outcome, "detail": detail})
        if outcome in ("traceback", "hang"):
            print(f"{outcome}: {name} {item[:120]}\n{detail}", flush=True)
    print(f"{len(cases)} cases in {time.monotonic() - started:.0f} s: {counts}")
    if args.json:
        args.json.write_text(json.dumps({"counts": counts, "cases": results}, indent=1))
    return 1 if counts.get("traceback") or counts.get("hang") else 0


if __name__ == "__main__":
    sys.exit(main())
