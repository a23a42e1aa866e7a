"""Evaluate a trained policy: `python -m spmd_rl.evaluate RUN_DIR|CHECKPOINT [--episodes N] [--stochastic]
[--seed S] [--max-steps N] [--video DIR] [--json] [--device cpu] [section.key=value ...]`.

In Python, one line loads a policy that acts like the trained one:

    policy, cfg = load_policy("runs/ppo_cartpole-20250101-120000")     # run dir, checkpoint dir or .pt file
    action = policy.act(obs, deterministic=True)["action"]              # obs as gymnasium gives it: numpy
    result = evaluate(policy, cfg.env, episodes=10, seed=0, deterministic=True)

A run directory gives its final policy.pt, or its latest checkpoint while the run has not finished;
RUN_DIR/checkpoints/latest names the newest checkpoint too. The policy is built from the run's config.yaml (the same
class, keys and seed as in training), then its weights are loaded. Its `act` takes one observation or a batch,
numpy or torch; given numpy it returns numpy, given one observation, outputs without the batch dimension.

For an env that reports a success flag (env.success_key), the line also gives the success rate with its 95% Wilson
interval, and the rate of success at the episodes' last step; for an env whose info names each episode's task
(MetaWorld's MT10), a line per task follows with its success rate.

Every episode ends after at most --max-steps steps (default: the env's own max_episode_steps, else 100000), so a
policy that never ends an episode cannot evaluate forever; the episodes that limit cut short are counted.

Video (--video DIR) records every evaluated episode of one env with gymnasium's RecordVideo; it needs the optional
extra: pip install -e ".[video]".
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from spmd_rl.config.loading import evaluation_env
from spmd_rl.envs.vector import check_same_spaces, probe_env
from spmd_rl.persist.fileio import make_dirs
from spmd_rl.run.evaluation import DEFAULT_MAX_STEPS, evaluate, probe_eval_env, require_moviepy
from spmd_rl.run.policies import load_policy
from spmd_rl.runtime.errors import USER_CODE_EXIT_CODE, USER_ERROR_EXIT_CODE, UserCodeError, UserError

__all__ = ["evaluate", "load_policy", "main"]


# -- command line ------------------------------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, like every other bad input (argparse's default adds the usage)
        self.exit(USER_ERROR_EXIT_CODE, f"{self.prog}: error: {message} (see --help)\n")


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="python -m spmd_rl.evaluate", description="Evaluate a trained policy on its env.")
    parser.add_argument(
        "path",
        type=Path,
        metavar="RUN_DIR|CHECKPOINT",
        help="a run directory, a checkpoint directory, or a policy.pt / rank0.pt file",
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="section.key=value",
        help="changes to the run's config (e.g. env.kwargs), as for spmd_rl.main",
    )
    parser.add_argument("--episodes", type=int, default=10, help="episodes to evaluate (default: %(default)s)")
    actions = parser.add_mutually_exclusive_group()  # deterministic by default, as evaluation during training
    actions.add_argument(
        "--deterministic", action="store_true", default=True, help="act with the policy's mode (the default)"
    )
    actions.add_argument(
        "--stochastic", dest="deterministic", action="store_false", help="sample actions from the policy instead"
    )
    parser.add_argument("--seed", type=int, default=0, help="seeds the envs and the policy's sampling (default: 0)")
    parser.add_argument(
        "--max-steps",
        type=int,
        metavar="N",
        help=f"end every episode after at most N steps (default: the env's max_episode_steps, else "
        f"{DEFAULT_MAX_STEPS})",
    )
    parser.add_argument("--video", type=Path, metavar="DIR", help="record every episode of one env as mp4 in DIR")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")
    parser.add_argument(
        "--eval-env",
        action="store_true",
        help="play on the config's eval.env settings (held-out kwargs or groups) instead of env's",
    )
    parser.add_argument("--device", default="cpu", help="torch device to act on (default: cpu)")
    args = parser.parse_intermixed_args(argv)  # overrides on both sides of an option (fault pass 9, CLI1)
    try:
        if args.episodes < 1:
            raise UserError(f"--episodes {args.episodes}: evaluate at least 1 episode")
        if args.seed < 0:
            raise UserError(f"--seed {args.seed}: give a seed >= 0")
        if args.max_steps is not None and args.max_steps < 1:
            raise UserError(f"--max-steps {args.max_steps}: allow at least 1 step per episode")
        if args.video is not None:
            require_moviepy()  # before any work: the one thing to install
            make_dirs(args.video)  # a file there, or no such place: one line (was os.makedirs' traceback, exit 1)
        policy, cfg = load_policy(args.path, args.device, args.overrides)
        env_cfg = evaluation_env(cfg) if args.eval_env else cfg.env
        if args.eval_env:  # the policy acts on env's spaces: eval.env (perhaps from the overrides) must keep them
            check_same_spaces(probe_env(cfg.env), probe_eval_env(cfg), "eval.env")
        result = evaluate(policy, env_cfg, args.episodes, args.seed, args.deterministic, args.video, args.max_steps)
    except UserError as exc:
        print(f"spmd_rl.evaluate: error: {exc}", file=sys.stderr)
        return USER_ERROR_EXIT_CODE
    except UserCodeError as exc:  # the env gave NaN (fault pass 9, N1): its line and exit 4, as in training
        print(f"spmd_rl.evaluate: error in user code: {exc}", file=sys.stderr)
        return USER_CODE_EXIT_CODE
    if args.json:
        print(json.dumps({"path": str(args.path), "env": cfg.env.id, **result}))
    else:
        acting = "deterministic" if args.deterministic else "sampled"
        print(
            f"{args.path} on {env_cfg.id}: return {result['return_mean']:.2f} ± {result['return_std']:.2f}, "
            f"length {result['length_mean']:.1f} ± {result['length_std']:.1f} over {result['episodes']} episodes "
            f"({acting} actions, seed {args.seed})"
            + (f"; {success_text(result)}" if "success_rate" in result else "")
            + (f"; {result['cut']} cut at {result['max_steps']} steps" if result["cut"] else "")
            + (f"; videos in {args.video}" if args.video else "")
        )
        for task, done in result.get("tasks", {}).items():  # several tasks in one env (MT10): one line each
            print(f"  task {task}: success {done['success_rate']:.2f} over {done['episodes']} episodes")
        for name, group in result.get("groups", {}).items():  # env groups: one line each
            print(
                f"  group {name}: return {group['return_mean']:.2f} ± {group['return_std']:.2f}, length "
                f"{group['length_mean']:.1f} over {group['episodes']} episodes"
                + (f"; {success_text(group)}" if "success_rate" in group else "")
            )
    return 0


def success_text(result: dict) -> str:
    low, high = result["success_interval"]
    return (
        f"success {result['success_rate']:.2f} (95% interval {low:.2f}-{high:.2f}), at the end "
        f"{result['success_at_end_rate']:.2f}"
    )


if __name__ == "__main__":
    sys.exit(main())
