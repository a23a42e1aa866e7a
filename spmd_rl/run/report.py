"""What happens on every trainer after every iteration: periodic evaluation, the metrics line, the callbacks.
Only the first trainer (global rank 0) holds a MetricsLogger and writes."""

from __future__ import annotations

import json
import numbers
import os
import shutil
from collections.abc import Mapping

from spmd_rl.config.loading import evaluation_env
from spmd_rl.config.sections import Config
from spmd_rl.interfaces.policy import Policy
from spmd_rl.persist.fileio import make_dirs, write_atomic
from spmd_rl.persist.run_files import BEST_DIR, SCORE_FILE, VIDEO_DIR
from spmd_rl.roles.trainer import Trainer
from spmd_rl.run.evaluation import evaluate
from spmd_rl.run.metrics import MetricsLogger
from spmd_rl.run.plan import Plan
from spmd_rl.run.policies import save_policy
from spmd_rl.runtime.errors import UserCodeError
from spmd_rl.runtime.watchdog import COLLECTIVE_MARGIN_S, watchdog


class Reporter:
    """report(iteration, metrics, statistics, trainer): evaluates when eval.every says so, builds the metrics.jsonl
    line (rank 0), lets the callbacks see it and add to it, and writes it."""

    def __init__(self, cfg: Config, plan: Plan, logger: MetricsLogger | None, callbacks: list, policy: Policy):
        self.plan = plan
        self.eval_cfg, self.env_cfg, self.seed = cfg.eval, evaluation_env(cfg), cfg.train.seed
        self.keep_best = cfg.checkpoint.keep_best
        self.logger = logger
        self.callbacks = callbacks
        self.policy = policy

    def __call__(self, iteration: int, metrics: dict, statistics: dict | None, trainer: Trainer) -> None:
        env_steps = (iteration + 1) * self.plan.steps_per_iteration
        logger = self.logger if statistics is not None else None  # the logging rank, with the gathered statistics
        evaluates = self.eval_cfg.every and (iteration + 1) % self.eval_cfg.every == 0
        # Sharded trainers all take part in gathering the whole policy that the logging rank evaluates.
        policy = trainer.whole_policy() if evaluates and trainer.sharded else self.policy
        if logger is not None and statistics is not None:
            # the whole metrics.jsonl line, periodic evaluation included, is what the callbacks see here
            if evaluates:
                assert policy is not None  # the logging rank is trainer 0, which holds the gathered copy
                metrics = {**metrics, **self.evaluate(iteration, policy)}
                if self.keep_best:
                    self.keep_if_best(iteration, env_steps, metrics["eval_return_mean"], policy)
            times = {"time_learn_s": trainer.learn_s, "time_weight_sync_s": trainer.weight_sync_s}
            record = logger.record(iteration, env_steps, metrics, statistics, times)
        else:
            record = {"iteration": iteration, "env_steps": env_steps, **metrics}
        for callback in self.callbacks:
            name = f"{type(callback).__module__}:{type(callback).__qualname__}"
            with watchdog.watch(f"callback {name}'s on_iteration_end (iteration {iteration})", COLLECTIVE_MARGIN_S):
                extra = callback.on_iteration_end(iteration, dict(record), trainer.algorithm)
            record.update(callback_scalars(name, iteration, extra))
        if logger is not None:
            logger.write(record)

    def evaluate(self, iteration: int, policy: Policy) -> dict[str, float]:
        """Episodes of policy (a whole one: the trained policy, or a sharded one's gathered copy) on envs of their
        own, with a generator of their own: training's RNG streams are untouched."""
        with watchdog.watch(f"the evaluation after iteration {iteration} ({self.eval_cfg.episodes} eval.episodes)"):
            result = evaluate(
                policy,
                self.env_cfg,
                self.eval_cfg.episodes,
                seed=self.seed * 1_000_003 + iteration,
                deterministic=self.eval_cfg.deterministic,
            )
        evaluations = (iteration + 1) // self.eval_cfg.every
        if self.eval_cfg.video_every and evaluations % self.eval_cfg.video_every == 0:
            self.record_video(iteration, policy)
        metrics = {
            "eval_return_mean": result["return_mean"],
            "eval_return_std": result["return_std"],
            "eval_length_mean": result["length_mean"],
        }
        if "success_rate" in result:  # an env that reports success
            metrics["eval_success_rate"] = result["success_rate"]
        for name, group in result.get("groups", {}).items():
            metrics[f"eval_return_mean/{name}"] = group["return_mean"]
            metrics[f"eval_length_mean/{name}"] = group["length_mean"]
            if "success_rate" in group:
                metrics[f"eval_success_rate/{name}"] = group["success_rate"]
        for task, done in result.get("tasks", {}).items():  # several tasks in one env (MT10)
            metrics[f"eval_success_rate/task/{task}"] = done["success_rate"]
        return metrics

    def record_video(self, iteration: int, policy: Policy) -> None:
        """One more episode, with the evaluation's seed and mode, recorded by gymnasium's RecordVideo into
        <run dir>/videos/iter_<I>/ (a group's in a folder of its own): a separate episode, so the evaluation's
        numbers stay what they are without video. Written to a scratch folder first: a folder there is whole."""
        assert self.logger is not None  # the logging rank's
        final = self.logger.run_dir / VIDEO_DIR / f"iter_{iteration:09d}"
        scratch = final.with_name(final.name + ".partial")
        shutil.rmtree(scratch, ignore_errors=True)  # left by a run killed while recording
        with watchdog.watch(f"the video after iteration {iteration} (eval.video_every={self.eval_cfg.video_every})"):
            evaluate(
                policy,
                self.env_cfg,
                1,
                seed=self.seed * 1_000_003 + iteration,
                deterministic=self.eval_cfg.deterministic,
                video_dir=scratch,
            )
        shutil.rmtree(final, ignore_errors=True)  # a resume that repeats the iteration records it again
        os.replace(scratch, final)

    def keep_if_best(self, iteration: int, env_steps: int, score: float, policy: Policy) -> None:
        """Save the policy to best/ when its evaluation beats the one saved there. The best score so far is the
        file's, so a resumed run goes on comparing against it."""
        assert self.logger is not None  # the logging rank's
        best = self.logger.run_dir / BEST_DIR
        score_file = best / SCORE_FILE
        if score_file.exists() and json.loads(score_file.read_text())["eval_return_mean"] >= score:
            return
        make_dirs(best)
        save_policy(policy, best)  # the policy first: a score never names weights that are not there yet
        write_atomic(
            score_file,
            json.dumps({"iteration": iteration, "env_steps": env_steps, "eval_return_mean": score}) + "\n",
        )

    def state_dict(self) -> dict:
        """What a checkpoint holds of the report: the logger's running statistics (rank 0), else nothing."""
        return self.logger.state_dict() if self.logger is not None else {}

    def load_state_dict(self, state: dict) -> None:
        if self.logger is not None:
            self.logger.load_state_dict(state)


def callback_scalars(name: str, iteration: int, extra) -> dict[str, float]:
    """What a callback returned, as metrics.jsonl scalars: None, or a mapping of names to real numbers (Python,
    numpy or one-element torch scalars). Anything else is the callback's error (exit 4) naming the key, not our
    traceback."""
    if extra is None:
        return {}
    where = f"callback {name}: on_iteration_end (iteration {iteration}) returned"
    if not isinstance(extra, Mapping):
        raise UserCodeError(
            f"{where} a {type(extra).__name__}; return None or a dict of scalars, e.g. {{'my_metric': 1.5}}"
        )
    scalars = {}
    for key, value in extra.items():
        if hasattr(value, "numel") and value.numel() == 1:  # a one-element tensor
            value = value.item()
        elif getattr(value, "ndim", None) == 0 and hasattr(value, "item"):  # a numpy scalar
            value = value.item()
        if not isinstance(key, str) or not isinstance(value, numbers.Real):
            raise UserCodeError(
                f"{where} {key!r}: {type(value).__name__} {str(value)[:60]!r}; each value must be a real number "
                f"under a string name"
            )
        scalars[key] = float(value)
    return scalars
