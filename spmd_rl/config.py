"""The run's configuration: a typed schema, YAML files, `a.b=value` overrides, and strict validation.

Every knob has one place: a field of a section dataclass below, with its default, its allowed range and a help
line. Loading rejects unknown keys (suggesting the nearest valid one), wrong types and out-of-range values with a
UserError that names the key; main turns that into exit code 2.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from spmd_rl.errors import UserError


def knob(default, help: str, *, min=None, max=None, choices=None, factory=None):
    """A config field with its help text and its allowed values."""
    meta = {"help": help, "min": min, "max": max, "choices": choices}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class RunSection:
    name: str = knob("ppo_cartpole", "run name; the default run directory is runs/<name>-<timestamp>")
    dir: str = knob("", "run directory (config.yaml, metrics.jsonl, TensorBoard events, policy); '' = default")


@dataclass
class EnvSection:
    id: str = knob("CartPole-v1", "gymnasium id, or 'package.module:EnvId' to import a user's env first")
    num_envs: int = knob(8, "environments per env rank (per rank in the colocated layout)", min=1)
    kwargs: dict = knob(None, "keyword arguments passed to gymnasium.make", factory=dict)
    vectorization: str = knob(
        "auto", "auto: the env's own vectorized implementation if it has one, else sync",
        choices=["auto", "vector_entry_point", "sync", "async"])
    normalize_reward: bool = knob(False, "scale rewards by a running estimate of the return's std (per env rank)")


@dataclass
class ModelSection:
    hidden_sizes: list[int] = knob(None, "hidden layer widths of the actor and the critic MLPs",
                                   factory=lambda: [64, 64])
    activation: str = knob("tanh", "hidden activation", choices=["tanh", "relu", "elu"])
    normalize_obs: bool = knob(False, "running observation normalization (model state, merged across trainers)")
    log_std_init: float = knob(0.0, "initial log std of the Gaussian policy (continuous actions)")


@dataclass
class AlgoSection:
    """The algorithm, and PPO's hyperparameters (SAC's are in the sac section)."""
    name: str = knob("ppo", "algorithm: ppo (on-policy) or sac (off-policy, replay buffer)", choices=["ppo", "sac"])
    num_steps: int = knob(32, "steps per environment in one rollout (one iteration); sac: per segment", min=1)
    learning_rate: float = knob(1e-3, "Adam learning rate", min=0.0)
    anneal_lr: bool = knob(True, "anneal the learning rate linearly to 0 over the run")
    gamma: float = knob(0.98, "discount factor", min=0.0, max=1.0)
    gae_lambda: float = knob(0.8, "GAE lambda", min=0.0, max=1.0)
    num_minibatches: int = knob(1, "minibatches per epoch (each trainer splits its share of the batch)", min=1)
    update_epochs: int = knob(20, "passes over the rollout per iteration", min=1)
    clip_coef: float = knob(0.2, "PPO clipping coefficient", min=0.0)
    anneal_clip: bool = knob(True, "anneal the clipping coefficient linearly to 0 over the run")
    clip_value_loss: bool = knob(False, "clip the value loss around the old values")
    ent_coef: float = knob(0.0, "entropy bonus coefficient", min=0.0)
    vf_coef: float = knob(0.5, "value loss coefficient", min=0.0)
    max_grad_norm: float = knob(0.5, "gradient norm clipping", min=0.0)
    normalize_advantages: bool = knob(True, "normalize advantages per minibatch")
    target_kl: float | None = knob(None, "stop the epochs early when approx_kl exceeds this (null = never)", min=0.0)


@dataclass
class SACSection:
    gamma: float = knob(0.99, "discount factor", min=0.0, max=1.0)
    tau: float = knob(0.005, "Polyak averaging rate of the target critics", min=0.0, max=1.0)
    batch_size: int = knob(256, "sampled transitions per gradient step, all trainers together", min=1)
    learning_starts: int = knob(5000, "env steps (all env ranks) of uniform random actions before learning", min=0)
    updates_per_step: float = knob(1.0, "gradient steps per env step (all env ranks together)", min=0.0)
    policy_lr: float = knob(3e-4, "actor (and entropy temperature) learning rate", min=0.0)
    q_lr: float = knob(1e-3, "critic learning rate", min=0.0)
    policy_frequency: int = knob(2, "update the actor every N critic updates (N times, TD3-style delay)", min=1)
    target_network_frequency: int = knob(1, "Polyak-update the target critics every N critic updates", min=1)
    alpha: float = knob(0.2, "entropy temperature (initial value when autotune)", min=0.0)
    autotune: bool = knob(True, "tune the temperature towards the target entropy -|A|")
    weight_sync_every: int = knob(1, "iterations between weight broadcasts to the inference ranks", min=1)


@dataclass
class BufferSection:
    capacity: int = knob(1_000_000, "replay capacity in transitions per trainer shard", min=1)
    backend: str = knob("memory", "replay storage: memory, or hdf5 (bounded memory, survives restarts)",
                        choices=["memory", "hdf5"])
    chunk_rows: int = knob(0, "HDF5 rows per chunk (appends are batched to whole chunks); 0 = automatic: ~1 MiB "
                              "of rows, or the existing file's", min=0)
    compression: str = knob("none", "HDF5 compression (fast codecs only)", choices=["none", "lzf"])
    log_experience: bool = knob(False, "append every collected rollout to <run dir>/buffer/experience_rank<R>.h5")

    @property
    def h5_compression(self) -> str | None:
        """The compression argument for h5py (None for "none")."""
        return None if self.compression == "none" else self.compression


@dataclass
class TrainSection:
    total_steps: int = knob(100_000, "budget in env steps, summed over all env ranks", min=1)
    seed: int = knob(1, "seeds torch, numpy and the environments (each rank offsets it by its rank)", min=0)
    torch_threads: int = knob(1, "torch intra-op threads per rank", min=1)
    device: str = knob("auto", "auto: cuda:LOCAL_RANK when CUDA is available, else cpu",
                       choices=["auto", "cpu", "cuda"])


@dataclass
class LayoutSection:
    mode: str = knob("colocated", "colocated: every rank plays every role; split: ranks divided into roles",
                     choices=["colocated", "split"])
    trainer: int = knob(0, "split: trainer ranks (-1 = the rest)", min=-1)
    inference: int = knob(0, "split: inference ranks (-1 = the rest)", min=-1)
    env: int = knob(0, "split: env ranks (-1 = the rest)", min=-1)


@dataclass
class DistSection:
    timeout_s: float = knob(300.0, "bound on every wait between ranks; an expired wait fails the job", min=0.001)


@dataclass
class WeightsSection:
    bucket_mb: float = knob(64.0, "size of one flat weight bucket broadcast to inference ranks", min=0.001)
    verify_every: int = knob(10, "compare weight checksums across the weight group every N syncs (0 = never)",
                             min=0)


@dataclass
class LogSection:
    progress: bool | None = knob(None, "progress bar on rank 0: true, false, or null = only on a terminal")
    interval_s: float = knob(5.0, "seconds between printed progress lines", min=0.0)
    tensorboard: bool = knob(True, "write TensorBoard event files to the run directory")


@dataclass
class Config:
    run: RunSection = field(default_factory=RunSection)
    env: EnvSection = field(default_factory=EnvSection)
    model: ModelSection = field(default_factory=ModelSection)
    algo: AlgoSection = field(default_factory=AlgoSection)
    sac: SACSection = field(default_factory=SACSection)
    buffer: BufferSection = field(default_factory=BufferSection)
    train: TrainSection = field(default_factory=TrainSection)
    layout: LayoutSection = field(default_factory=LayoutSection)
    dist: DistSection = field(default_factory=DistSection)
    weights: WeightsSection = field(default_factory=WeightsSection)
    log: LogSection = field(default_factory=LogSection)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def digest(self) -> str:
        """A hash of the resolved config; every rank compares it with rank 0's."""
        return hashlib.sha256(yaml.safe_dump(self.to_dict(), sort_keys=True).encode()).hexdigest()


# ---------------------------------------------------------------------------------------------------------------
# Loading


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> Config:
    """Defaults <- YAML file <- `a.b=value` overrides, all validated.

    The defaults are the embedded default run (PPO on CartPole-v1, the same as configs/ppo_cartpole.yaml), so
    `python -m spmd_rl.main` needs no file.
    """
    raw = _read_yaml(Path(path)) if path is not None else {}
    for item in overrides:
        _apply_override(raw, item)
    return _build(Config, raw, prefix="", source=str(path) if path is not None else "the command line")


def _read_yaml(path: Path) -> dict:
    if not path.is_file():
        raise UserError(f"config file {path} does not exist; pass --config with a YAML file (see configs/)")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise UserError(f"config file {path} is not valid YAML{where}: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(f"config file {path} must hold a mapping of sections (run:, env:, algo:, ...), "
                        f"not a {type(data).__name__}")
    return data


def _apply_override(raw: dict, item: str) -> None:
    key, sep, text = item.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise UserError(f"override '{item}' must look like section.key=value (e.g. train.total_steps=50000)")
    try:
        value = yaml.safe_load(text) if text != "" else ""
    except yaml.YAMLError:
        value = text  # not YAML: keep the literal text, the type check below judges it
    node = raw
    parts = key.split(".")
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise UserError(f"override '{item}': '{part}' is not a section")
        node = child
    node[parts[-1]] = value


def _build(cls, raw: Any, prefix: str, source: str):
    where = prefix.rstrip(".") or "the top level"
    if not isinstance(raw, dict):
        raise UserError(f"config key '{where}' must be a mapping of keys, got {raw!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    for key in raw:
        if key not in fields:
            name = f"{prefix}{key}"
            allowed = sorted(f"{prefix}{k}" for k in fields)
            near = difflib.get_close_matches(name, allowed, n=1, cutoff=0.6)
            hint = f"; did you mean '{near[0]}'?" if near else f"; valid keys: {', '.join(allowed)}"
            raise UserError(f"unknown config key '{name}' (in {source}){hint}")
    values = {}
    for name, f in fields.items():
        if name not in raw:
            continue
        kind = hints[name]
        if dataclasses.is_dataclass(kind):
            values[name] = _build(kind, raw[name], f"{prefix}{name}.", source)
        else:
            values[name] = _check_value(f"{prefix}{name}", raw[name], kind, f.metadata)
    return cls(**values)


def _check_value(key: str, value: Any, kind, meta) -> Any:
    value = _check_type(key, value, kind)
    if value is None:
        return value
    if isinstance(value, float) and not math.isfinite(value):
        raise UserError(f"config key '{key}' = {value!r} must be a finite number")
    if meta.get("choices") and value not in meta["choices"]:
        near = difflib.get_close_matches(str(value), meta["choices"], n=1)
        hint = f"; did you mean '{near[0]}'?" if near else ""
        raise UserError(f"config key '{key}' = {value!r} is not allowed; choose one of "
                        f"{', '.join(meta['choices'])}{hint}")
    low, high = meta.get("min"), meta.get("max")
    if low is not None and value < low:
        raise UserError(f"config key '{key}' = {value!r} is out of range; it must be >= {low}")
    if high is not None and value > high:
        raise UserError(f"config key '{key}' = {value!r} is out of range; it must be <= {high}")
    return value


def _type_name(kind) -> str:
    return getattr(kind, "__name__", None) or str(kind).replace("typing.", "")


def _check_type(key: str, value: Any, kind) -> Any:
    origin = typing.get_origin(kind)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(kind)
        if value is None and type(None) in options:
            return None
        (inner,) = [o for o in options if o is not type(None)]
        return _check_type(key, value, inner)
    wrong = UserError(f"config key '{key}' must be {_type_name(kind)}, got {value!r} ({type(value).__name__})")
    if kind is bool:
        if not isinstance(value, bool):
            raise wrong
        return value
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise wrong
        return value
    if kind is float:
        if isinstance(value, str):
            # YAML 1.1 reads 3e-4 (no dot) as a string; accept what Python reads as a number.
            try:
                return float(value)
            except ValueError:
                raise wrong from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise wrong
        return float(value)
    if kind is str:
        if not isinstance(value, str):
            raise wrong
        return value
    if kind is dict:
        if not isinstance(value, dict):
            raise wrong
        return value
    if origin is list:
        (inner,) = typing.get_args(kind)
        if not isinstance(value, list):
            raise wrong
        return [_check_type(f"{key}[{i}]", v, inner) for i, v in enumerate(value)]
    raise TypeError(f"unsupported config type {kind} for {key}")


def describe_schema() -> str:
    """Every section and key with its type, default and help line, for --help."""
    lines = []
    for section in dataclasses.fields(Config):
        cls = typing.get_type_hints(Config)[section.name]
        lines.append(f"  {section.name}:")
        hints = typing.get_type_hints(cls)
        defaults = cls()
        for f in dataclasses.fields(cls):
            default = getattr(defaults, f.name)
            extra = ""
            if f.metadata.get("choices"):
                extra = f" [{'|'.join(f.metadata['choices'])}]"
            lines.append(f"    {section.name}.{f.name} ({_type_name(hints[f.name])}, default {default!r}){extra}: "
                         f"{f.metadata.get('help', '')}")
    return "\n".join(lines)
