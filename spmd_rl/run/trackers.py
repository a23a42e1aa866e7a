"""Optional experiment trackers on rank 0: Weights & Biases (`log.wandb`) and MLflow (`log.mlflow`) get the scalars
TensorBoard gets, at x = env_steps, and the resolved config.

Each package is imported only here, when its key is on (importing wandb alone takes seconds); `check_installed`
finds a missing one before any process group with importlib's find_spec, without importing it.

A resumed run continues the same tracker run: its id is kept in the run directory (`wandb_run_id`,
`mlflow_run_id`), written when the run starts and read back when it resumes from a checkpoint; a run that starts
over at iteration 0 gets a new one. Steps a tracker run already holds are not logged again: a resume that goes back
to an earlier step (a crash after the checkpoint) keeps the stopped run's values for the steps it had logged there
and continues after them (W&B drops steps that go backwards; for MLflow they are skipped here).

A tracker that fails while the run goes on (a server gone) says so in one line and is dropped: training continues,
metrics.jsonl and TensorBoard still hold every record.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import secrets
import sys
import threading
import time
from pathlib import Path
from typing import Literal, cast

from spmd_rl.config.excerpts import clip
from spmd_rl.config.sections import Config
from spmd_rl.persist.fileio import write_atomic
from spmd_rl.runtime.errors import (
    STOPPED_EXIT_CODE,  # W&B records a stop with the process's exit code
    UserError,
)

# config key -> (the module it imports, the pip extra that installs it)
PACKAGES = {"log.wandb": ("wandb", "wandb"), "log.mlflow": ("mlflow", "mlflow")}


def check_installed(cfg: Config) -> None:
    """Each tracker that is on needs its package: a UserError naming the key and the extra otherwise."""
    for key, (module, extra) in PACKAGES.items():
        if getattr(cfg.log, key.split(".")[1]):
            require_package(key, module, extra)


def require_package(key: str, module: str, extra: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise UserError(f"config key '{key}' = true needs the {module} package: pip install -e \".[{extra}]\"")


def open_trackers(cfg: Config, run_dir: Path, resumed: bool) -> Trackers | None:
    """The trackers the config turns on, each with its run started (or reopened when resumed); None when none is
    on. A tracker that cannot start is a UserError saying which and why (the others are closed first)."""
    opened = []
    try:
        if cfg.log.wandb:
            opened.append(WandbSink(cfg, run_dir, resumed))
        if cfg.log.mlflow:  # its client retries a refused address for minutes: the ranks wait dist.timeout_s
            opened.append(within_timeout(lambda: MlflowSink(cfg, run_dir, resumed), cfg, "log.mlflow"))
    except BaseException:
        for sink in opened:
            sink.close("failed")
        raise
    return Trackers(opened) if opened else None


def within_timeout(start, cfg: Config, key: str):
    """start() in a thread of its own, waited for at most dist.timeout_s (the other ranks wait no longer for rank 0
    either): its result, or the error it raised; a UserError naming the key when it has not returned by then (the
    thread is left to the process's exit)."""
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["value"] = start()
        except BaseException as exc:  # noqa: BLE001 - raised again in the caller's thread
            outcome["error"] = exc

    thread = threading.Thread(target=run, name=f"spmd_rl-{key}", daemon=True)
    thread.start()
    thread.join(cfg.dist.timeout_s)
    if thread.is_alive():
        uri = getattr(cfg.log, f"{key.split('.')[-1]}_tracking_uri", "") or "the default address"
        raise UserError(
            f"config key '{key}': the tracker did not start within dist.timeout_s={cfg.dist.timeout_s:g} s (its "
            f"server at {uri} does not answer); check its address, or set {key}=false to run without it"
        )
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


class Trackers:
    """The open sinks; one that raises is reported and dropped."""

    def __init__(self, sinks: list):
        self.sinks = sinks

    def log(self, scalars: dict[str, float], env_steps: int) -> None:
        for sink in list(self.sinks):
            try:
                sink.log(scalars, env_steps)
            except Exception as exc:
                self.sinks.remove(sink)
                print(
                    f"spmd_rl: {sink.key}: logging failed ({type(exc).__name__}: {_first_line(exc)}); the run "
                    f"continues without it (metrics.jsonl and TensorBoard have every record)",
                    file=sys.stderr,
                    flush=True,
                )

    def close(self, status: str) -> None:
        """status: finished, stopped (a checkpointed stop: the run will resume) or failed."""
        for sink in self.sinks:
            try:
                sink.close(status)
            except Exception as exc:
                print(f"spmd_rl: {sink.key}: closing failed ({_first_line(exc)})", file=sys.stderr, flush=True)
        self.sinks = []


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else "no message"


def _cannot_start(key: str, run: str, exc: BaseException, message: str, advice: str) -> UserError:
    """The one line for a tracker whose run did not start: its key, the run, the error and what to do."""
    return UserError(f"config key '{key}': cannot start {run} ({type(exc).__name__}: {message}); {advice}")


def _kept_id(run_dir: Path, name: str, resumed: bool) -> str | None:
    """The tracker run id kept in run_dir/name when the run resumes from a checkpoint (None: start a new one)."""
    path = run_dir / name
    if resumed and path.exists():
        return path.read_text().strip() or None
    return None


def _flat(config: dict, prefix: str = "") -> dict[str, str]:
    """The config as MLflow params: section.key -> text (lists as JSON)."""
    out = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flat(value, f"{name}."))
        else:
            out[name] = value if isinstance(value, str) else json.dumps(value)
    return out


class WandbSink:
    key = "log.wandb"

    def __init__(self, cfg: Config, run_dir: Path, resumed: bool):
        import wandb  # imported only when asked for: it takes seconds

        log = cfg.log
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", run_dir.name)[:48]
        run_id = _kept_id(run_dir, "wandb_run_id", resumed)
        if run_id is None:
            run_id = f"{safe}-{secrets.token_hex(4)}"
            write_atomic(run_dir / "wandb_run_id", run_id + "\n")
        try:
            self.run = wandb.init(
                project=log.wandb_project,
                id=run_id,
                name=run_dir.name,
                resume="allow",
                # WANDB_MODE wins; log.wandb_mode is one of its knob's choices
                mode=None if os.environ.get("WANDB_MODE") else cast(Literal["online", "offline"], log.wandb_mode),
                dir=None if os.environ.get("WANDB_DIR") else str(run_dir),  # so does WANDB_DIR
                settings=wandb.Settings(console="off"),  # the console stays the launcher's
            )
            self.run.config.update(cfg.to_dict(), allow_val_change=True)  # a resume may change run/log keys
            self.next_step = self.run.step  # W&B's next step: the steps below it are logged already (online)
        except Exception as exc:
            advice = "log in with `wandb login`, or set log.wandb_mode=offline (`wandb sync` uploads it later)"
            raise _cannot_start(self.key, "a W&B run", exc, _first_line(exc), advice) from None

    def log(self, scalars: dict[str, float], env_steps: int) -> None:
        if env_steps >= self.next_step:
            self.run.log(scalars, step=env_steps)

    def close(self, status: str) -> None:
        self.run.finish(exit_code={"finished": 0, "stopped": STOPPED_EXIT_CODE}.get(status, 1))


class MlflowSink:
    key = "log.mlflow"
    BATCH = 1000  # MLflow's limit on metrics per log_batch call
    PARAMS = 100  # and on params
    PARAM_CHARS = 500  # a param value's length every MLflow version accepts (the whole config is an artifact)

    def __init__(self, cfg: Config, run_dir: Path, resumed: bool):
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        log = cfg.log
        bound_mlflow_requests(cfg.dist.timeout_s)
        self.metric = Metric
        self.logged_through = -1  # the last step the MLflow run holds (a resumed run skips to after it)
        try:
            self.client = MlflowClient(tracking_uri=log.mlflow_tracking_uri or None)
            run_id = _kept_id(run_dir, "mlflow_run_id", resumed)
            if run_id is not None:
                self.run_id = run_id
                self.client.update_run(run_id, status="RUNNING")
                history = self.client.get_metric_history(run_id, "wall_s")  # every record has wall_s
                self.logged_through = max((m.step for m in history), default=-1)
            else:
                experiment = self.client.get_experiment_by_name(log.mlflow_experiment)
                experiment_id = (
                    experiment.experiment_id if experiment else self.client.create_experiment(log.mlflow_experiment)
                )
                self.run_id = self.client.create_run(
                    experiment_id, run_name=run_dir.name, tags={"spmd_rl.run_dir": str(run_dir.resolve())}
                ).info.run_id
                write_atomic(run_dir / "mlflow_run_id", self.run_id + "\n")
                params = [Param(k, v[: self.PARAM_CHARS]) for k, v in _flat(cfg.to_dict()).items()]
                for start in range(0, len(params), self.PARAMS):
                    self.client.log_batch(self.run_id, params=params[start : start + self.PARAMS])
            self.client.log_dict(self.run_id, cfg.to_dict(), "config.yaml")  # this process's config, whole
        except Exception as exc:
            run = f"an MLflow run at {_tracking_uri(log.mlflow_tracking_uri)}"
            advice = _mlflow_advice(log.mlflow_tracking_uri)
            raise _cannot_start(self.key, run, exc, _whole_message(exc), advice) from None

    def log(self, scalars: dict[str, float], env_steps: int) -> None:
        if env_steps <= self.logged_through:
            return
        stamp = int(time.time() * 1000)
        metrics = [self.metric(key, float(value), stamp, env_steps) for key, value in scalars.items()]
        for start in range(0, len(metrics), self.BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[start : start + self.BATCH])

    def close(self, status: str) -> None:
        self.client.set_terminated(self.run_id, {"finished": "FINISHED", "stopped": "KILLED"}.get(status, "FAILED"))


def bound_mlflow_requests(timeout_s: float) -> None:
    """Fit one MLflow request with all its retries (starting the run, each iteration's log_batch, the end) in half of
    dist.timeout_s, the longest rank 0 may keep the other ranks waiting: MLflow's client retries a failed request 7
    times with a doubling backoff (about 4 minutes for a refused address) and waits 120 s for each answer. Retries
    with a backoff of 1 s, 2 s, 4 s, ... take about 2^retries + retries s (a second of jitter each); what is left
    goes to the requests' own waits. The MLFLOW_HTTP_REQUEST_* variables a user set stay as set."""
    budget = timeout_s / 2
    retries = 0
    while 2 ** (retries + 1) + retries + 1 <= budget / 2:
        retries += 1
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", str(retries))
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(max(1, int(budget / (2 * (retries + 1))))))


SERVER_HINT = "point log.mlflow_tracking_uri (or MLFLOW_TRACKING_URI) at a tracking server (http://host:5000)"


def _tracking_uri(given: str) -> str:
    """The URI MLflow used: log.mlflow_tracking_uri, else MLFLOW_TRACKING_URI, else MLflow's default (named)."""
    if given:
        return given
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return f"{os.environ['MLFLOW_TRACKING_URI']} (MLFLOW_TRACKING_URI)"
    import mlflow

    return f"{mlflow.get_tracking_uri()} (MLflow's default)"


def _mlflow_advice(given: str) -> str:
    """What to do, by the scheme of the URI that failed (the mlflow extra is mlflow-skinny: a client only)."""
    uri = given or os.environ.get("MLFLOW_TRACKING_URI", "")
    if not uri:
        import mlflow

        uri = mlflow.get_tracking_uri()
    scheme = uri.partition(":")[0].lower() if re.match(r"[A-Za-z][A-Za-z0-9+.-]*:", uri) else "file"
    if scheme in ("sqlite", "postgresql", "mysql", "mssql") or scheme.startswith(("postgresql+", "mysql+")):
        return (
            f"a database store needs the full MLflow (pip install mlflow, not the client mlflow-skinny); or "
            f"{SERVER_HINT}"
        )
    if scheme == "file" and os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").lower() not in ("true", "1"):
        return (
            f"MLflow 3 opens a file store only with MLFLOW_ALLOW_FILE_STORE=true in the environment; or {SERVER_HINT}"
        )
    if scheme in ("http", "https"):
        return "is a tracking server running there (mlflow server --port 5000)? or correct log.mlflow_tracking_uri"
    return SERVER_HINT


def _whole_message(exc: BaseException) -> str:
    """The exception's message on one line, whole up to 1000 characters (MLflow's say what to do at their end)."""
    return clip(" ".join(str(exc).split()), 1000) or "no message"
