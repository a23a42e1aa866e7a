"""The program every rank runs: `python -m spmd_rl.main [--config FILE] [--dry-run] [section.key=value ...]`.

Everything a user can get wrong is checked before any process group exists (config, the classes it names, layout,
env id, spaces, the policy's declared outputs against what it returns), so bad input ends every rank with exit
code 2 and one line, never a hang or a traceback. torch is imported only after the config is read, so `--help` and
config errors answer at once.

Exit codes: 0 done, 2 user error (config, files, plug-in contract), 3 communication error, 4 an error in the
user's code (env, policy, algorithm, callback) or bad data from it, 128 + N stopped by signal N.
"""

from __future__ import annotations

import argparse
import sys

from spmd_rl.config.loading import describe_schema, load_config
from spmd_rl.runtime.errors import UserError
from spmd_rl.runtime.exits import user_error
from spmd_rl.runtime.launch import detect_launch, rank_from_env

USAGE_EXAMPLES = """\
examples:
  python -m spmd_rl.main                                    # PPO on CartPole-v1 in one process
  python -m spmd_rl.main --config configs/ppo_pendulum.yaml train.total_steps=200000
  torchrun --standalone --nproc_per_node=8 -m spmd_rl.main --config configs/ppo_cartpole_split.yaml
  python -m spmd_rl.main --config my.yaml policy.class=my_pkg.nets:MyPolicy --dry-run

config sections and keys (override any with section.key=value); the algo, policy, engine and callbacks sections
list the keys of the classes this config selects:
"""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m spmd_rl.main",
        add_help=False,
        description="Train a policy with spmd_rl. Every rank runs this same program (torchrun, mpirun, srun, or "
        "one process).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "-h",
        "--help",
        action="store_true",
        help="show this help (with the keys of the classes the given config selects) and exit",
    )
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="YAML config (default: the embedded PPO CartPole-v1 config, the same as configs/ppo_cartpole.yaml)",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="run one real iteration in the real layout (every "
        "role, every channel, one weight sync) in a temporary run directory, then exit 0",
    )
    parser.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides")
    args = parser.parse_args(argv)
    args.format_help = parser.format_help
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Everything a user can get wrong, checked before any process group exists. The config and the layout are
    # the same on every rank, so rank 0 speaks for all; the env (its packages, its files) belongs to a host, so
    # the first rank of every host speaks for it.
    try:
        cfg = load_config(args.config, args.overrides)
    except UserError as exc:  # before the launch is known: the launcher's rank variable says who is rank 0
        return user_error(exc, speaker=rank_from_env() in (None, 0))
    if args.help:
        print(args.format_help() + "\n" + USAGE_EXAMPLES + describe_schema(cfg))
        return 0
    try:
        launch = detect_launch()
    except UserError as exc:
        return user_error(exc, speaker=True)

    # Imported only now: torch, tensordict and the envs take seconds, and --help and config errors answer without.
    from spmd_rl.run.driver import train

    return train(cfg, launch, dry_run=args.dry_run)


if __name__ == "__main__":
    sys.exit(main())
