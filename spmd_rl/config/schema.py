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

from spmd_rl.runtime.errors import UserError


def knob(default, help: str, *, min=None, max=None, choices=None, item_min=None, item_max=None, factory=None):
    """A config field with its help text and its allowed values (item_min/item_max: bounds on a list's items)."""
    meta = {"help": help, "min": min, "max": max, "choices": choices, "item_min": item_min, "item_max": item_max}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class RunSection:
    name: str = knob("ppo_cartpole", "run name; the default run directory is runs/<name>-<timestamp>")
    dir: str = knob("", "run directory (config.yaml, metrics.jsonl, TensorBoard events, policy, checkpoints); '' = "
                        "runs/<name>-<timestamp>, or runs/<name>-<torchrun run id> under torchrun (stable across "
                        "its restarts)")
    resume: str = knob("auto", "auto: a run directory with a checkpoint resumes from the latest one; never: refuse a "
                       "run directory that holds a run; or the path of a checkpoint (or of its run directory)")
    init_from: str = knob("", "start from trained weights: a run directory, a checkpoint or a policy.pt (fine-tune)")
    init_algorithm: bool = knob(False, "with run.init_from a checkpoint: also take the algorithm's state "
                                "(optimizers, critics, ...), not only the policy")
    stop_after_iterations: int = knob(0, "stop after this many iterations with a checkpoint (exit 75), as a signal "
                                      "would; rerun to continue (0 = run to the end)", min=0)


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
class EvalSection:
    every: int = knob(0, "evaluate the policy every N iterations on separate envs (0 = never); logged as "
                      "eval_return_mean / eval_length_mean", min=0)
    episodes: int = knob(10, "episodes per evaluation", min=1)
    deterministic: bool = knob(True, "act with the policy's mode (argmax / mean) when evaluating")


@dataclass
class CheckpointSection:
    every_iterations: int = knob(0, "checkpoint every N iterations (0 = by time only); always after the last one",
                                 min=0)
    every_s: float = knob(600.0, "checkpoint when this many seconds passed since the last one (rank 0's clock, "
                          "agreed by all ranks; 0 = never by time)", min=0.0)
    keep: int = knob(2, "complete checkpoints kept (older ones are deleted)", min=1)


@dataclass
class AlgorithmConfig:
    """The keys every algorithm has: its own Config subclasses this (spmd_rl.api re-exports it)."""
    num_steps: int = knob(32, "steps per environment in one rollout (one iteration)", min=1)


@dataclass
class NoConfig:
    """The config of a plug-in class that has no keys of its own."""


@dataclass
class BufferSection:
    capacity: int = knob(1_000_000, "replay capacity in transitions per trainer shard", min=1, max=10**9)
    backend: str = knob("memory", "replay storage: memory, or hdf5 (bounded memory, survives restarts)",
                        choices=["memory", "hdf5"])
    chunk_rows: int = knob(0, "HDF5 rows per chunk (appends are batched to whole chunks); 0 = automatic: ~1 MiB "
                              "of rows, or the existing file's", min=0, max=2**22)
    compression: str = knob("none", "HDF5 compression (fast codecs only)", choices=["none", "lzf"])
    log_experience: bool = knob(False, "append every collected rollout to <run dir>/buffer/experience_rank<R>.h5")
    flush_every_s: float = knob(2.0, "HDF5 files (experience log, hdf5 replay): rows staged in memory are written "
                                     "within this many seconds of being added (what kill -9 can lose); 0 = on every "
                                     "append", min=0.0)

    @property
    def h5_compression(self) -> str | None:
        """The compression argument for h5py (None for "none")."""
        return None if self.compression == "none" else self.compression


@dataclass
class TrainSection:
    total_steps: int = knob(100_000, "budget in env steps, summed over all env ranks", min=1, max=10**12)
    seed: int = knob(1, "seeds torch, numpy and the environments (each rank offsets it by its rank)", min=0,
                     max=2**32 - 1)
    torch_threads: int = knob(1, "torch intra-op threads per rank", min=1, max=1024)
    device: str = knob("auto", "auto: cuda:LOCAL_RANK when CUDA is available, else cpu",
                       choices=["auto", "cpu", "cuda"])
    skip_nonfinite_updates: bool = knob(False, "an update whose loss or policy weights come out NaN/inf is undone "
                                               "and counted (metric nonfinite_updates_skipped) instead of ending "
                                               "the run with exit code 4")


@dataclass
class LayoutSection:
    mode: str = knob("colocated", "colocated: every rank plays every role; split: ranks divided into roles",
                     choices=["colocated", "split"])
    trainer: int = knob(0, "split: trainer ranks (-1 = the rest)", min=-1)
    inference: int = knob(0, "split: inference ranks (-1 = the rest)", min=-1)
    env: int = knob(0, "split: env ranks (-1 = the rest)", min=-1)


@dataclass
class DistSection:
    timeout_s: float = knob(300.0, "bound on every wait between ranks; an expired wait fails the job", min=0.001,
                            max=7 * 24 * 3600.0)


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


PLUGIN_SECTIONS = ("algo", "policy", "engine")  # each names a class (`class: module:Class`) and holds its keys


@dataclass
class Config:
    run: RunSection = field(default_factory=RunSection)
    env: EnvSection = field(default_factory=EnvSection)
    # The plug-in sections hold an instance of the named class's own Config dataclass; `classes` records which
    # class each names (section -> alias or module:Class), and `callbacks` is a list of (class, config) pairs.
    algo: Any = None
    policy: Any = None
    engine: Any = None
    callbacks: list = field(default_factory=list)
    buffer: BufferSection = field(default_factory=BufferSection)
    train: TrainSection = field(default_factory=TrainSection)
    layout: LayoutSection = field(default_factory=LayoutSection)
    dist: DistSection = field(default_factory=DistSection)
    weights: WeightsSection = field(default_factory=WeightsSection)
    log: LogSection = field(default_factory=LogSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    eval: EvalSection = field(default_factory=EvalSection)
    classes: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        """The resolved config as plain data: what config.yaml holds and what --config reads back."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "classes":
                continue
            if f.name in PLUGIN_SECTIONS:
                out[f.name] = {"class": self.classes[f.name], **dataclasses.asdict(value)}
            elif f.name == "callbacks":
                out[f.name] = [{"class": name, **dataclasses.asdict(config)} for name, config in value]
            else:
                out[f.name] = dataclasses.asdict(value)
        return out

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def digest(self) -> str:
        """A hash of the resolved config; every rank compares it with rank 0's."""
        return hashlib.sha256(yaml.safe_dump(self.to_dict(), sort_keys=True).encode()).hexdigest()

    def resume_digest(self) -> str:
        """A hash of what a resumed run must share with the run it continues: everything but where and how it is
        run (run, checkpoint, log) and the bound on waits."""
        data = {k: v for k, v in self.to_dict().items() if k not in ("run", "checkpoint", "log")}
        data["dist"] = {k: v for k, v in data["dist"].items() if k != "timeout_s"}
        return hashlib.sha256(yaml.safe_dump(data, sort_keys=True).encode()).hexdigest()


# ---------------------------------------------------------------------------------------------------------------
# Loading


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> Config:
    """Defaults <- YAML file <- `a.b=value` overrides, all validated.

    The defaults are the embedded default run (PPO on CartPole-v1, the same as configs/ppo_cartpole.yaml), so
    `python -m spmd_rl.main` needs no file.
    """
    raw = _read_yaml(Path(path)) if path is not None else {}
    given: dict[str, str] = {}
    for item in overrides:
        _apply_override(raw, item)
        _reject_repeated_override(given, item)
    source = str(path) if path is not None else "the command line"
    for legacy, hint in (("model", "policy"), ("sac", "algo")):
        if legacy in raw:
            raise UserError(f"config section '{legacy}' (in {source}) was folded into '{hint}': move its keys under "
                            f"'{hint}:' (see configs/)")
    if "classes" in raw:  # bookkeeping of the plug-in sections, not a section of its own
        raise UserError(f"unknown config key 'classes' (in {source}); name a class with algo.class, policy.class, "
                        f"engine.class or callbacks")
    plugin_raw = {name: raw.pop(name) for name in (*PLUGIN_SECTIONS, "callbacks") if name in raw}
    cfg = _build(Config, raw, prefix="", source=source)
    _build_plugin_sections(cfg, plugin_raw, source)
    return cfg


def _build_plugin_sections(cfg: Config, raw: dict, source: str) -> None:
    """algo, policy, engine and callbacks: each names its class, whose own Config dataclass validates the rest.

    The algorithm is resolved first: an absent policy.class means the algorithm's default policy."""
    from spmd_rl.config import plugins

    def build(section: str, kind, value, default_class: str, prefix: str):
        if value is None:
            value = {}
        if isinstance(value, str):  # `callbacks: [pkg.mod:Cls]` and `engine: sync` name a class with no keys
            value = {"class": value}
        if not isinstance(value, dict):
            raise UserError(f"config key '{prefix.rstrip('.')}' must be a mapping with a 'class' key and the "
                            f"class's own keys (in {source}), got {value!r}")
        value = dict(value)
        name = value.pop("class", default_class)
        if not isinstance(name, str) or not name:
            raise UserError(f"config key '{prefix}class' must name a class (an alias or module:Class), got {name!r}")
        config_cls = plugins.config_class(kind, name)
        return name, _build(config_cls, value, prefix, f"{source}; keys of {kind.what} '{name}'")

    algo_raw = raw.get("algo")
    if isinstance(algo_raw, dict) and "name" in algo_raw and "class" not in algo_raw:
        raise UserError(f"config key 'algo.name' (in {source}) is now 'algo.class' (ppo, sac or module:Class)")
    cfg.classes["algo"], cfg.algo = build("algo", plugins.ALGORITHM, algo_raw, "ppo", "algo.")
    if not isinstance(cfg.algo, AlgorithmConfig):
        raise UserError(f"algo.class '{cfg.classes['algo']}': its Config must subclass spmd_rl.api.AlgorithmConfig "
                        f"(which gives every algorithm algo.num_steps)")
    default_policy = getattr(type(cfg.algo), "default_policy", "actor_critic")
    cfg.classes["policy"], cfg.policy = build("policy", plugins.POLICY, raw.get("policy"), default_policy,
                                              "policy.")
    cfg.classes["engine"], cfg.engine = build("engine", plugins.ENGINE, raw.get("engine"), "sync", "engine.")
    callbacks = raw.get("callbacks") or []
    if not isinstance(callbacks, list):
        raise UserError(f"config key 'callbacks' must be a list of classes (module:Class), got {callbacks!r}")
    cfg.callbacks = [build("callbacks", plugins.CALLBACK, item, "", f"callbacks[{i}].")
                     for i, item in enumerate(callbacks)]


class _DuplicateKeyError(yaml.YAMLError):
    def __init__(self, key: str, first_line: int, line: int):
        super().__init__(f"key '{key}' appears twice (lines {first_line} and {line})")
        self.key, self.first_line, self.line = key, first_line, line


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that a key given twice in one mapping is an error instead of last-one-wins."""

    def construct_document(self, node):
        self._reject_duplicate_keys(node, "", set())
        return super().construct_document(node)

    def _reject_duplicate_keys(self, node, prefix: str, seen: set[int]) -> None:
        if id(node) in seen:  # an alias: checked where its anchor is (and anchors may be recursive)
            return
        seen.add(id(node))
        if isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                self._reject_duplicate_keys(item, f"{prefix}[{i}]", seen)
        elif isinstance(node, yaml.MappingNode):
            first_line: dict[tuple[str, str], int] = {}
            for key_node, value_node in node.value:
                # Keys a `<<: *anchor` merge brings in may be overridden: that is YAML's rule, not a mistake.
                if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = f"{prefix}{key_node.value}"
                line = key_node.start_mark.line + 1
                same = (key_node.tag, key_node.value)  # the resolved tag tells `1` from "1": different keys
                if same in first_line:
                    raise _DuplicateKeyError(key, first_line[same], line)
                first_line[same] = line
                self._reject_duplicate_keys(value_node, f"{key}.", seen)


def _read_yaml(path: Path) -> dict:
    if path.is_dir():
        raise UserError(f"config file {path} is a directory; pass --config with a YAML file (see configs/)")
    if not path.is_file():
        raise UserError(f"config file {path} does not exist; pass --config with a YAML file (see configs/)")
    try:
        text = path.read_text()
    except OSError as exc:
        raise UserError(f"config file {path} cannot be read ({exc.strerror}); check its permissions") from None
    except UnicodeDecodeError:
        raise UserError(f"config file {path} is not text (not UTF-8); pass --config with a YAML file") from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)
    except _DuplicateKeyError as exc:
        raise UserError(f"config file {path} gives key '{exc.key}' twice (lines {exc.first_line} and {exc.line}); "
                        f"keep one") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise UserError(f"config file {path} is not valid YAML{where}: {problem}") from None
    if data is None:  # nothing but comments, or nothing at all: probably the wrong file
        raise UserError(f"config file {path} is empty; give it sections (see configs/), or leave out --config to "
                        f"run the defaults")
    if not isinstance(data, dict):
        raise UserError(f"config file {path} must hold a mapping of sections (run:, env:, algo:, ...), "
                        f"not a {type(data).__name__}")
    return data


def _apply_override(raw: dict, item: str) -> None:
    key, sep, text = item.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise UserError(f"override '{item}' must look like section.key=value (e.g. train.total_steps=50000)")
    try:
        value = yaml.load(text, Loader=_UniqueKeyLoader) if text != "" else ""
    except _DuplicateKeyError as exc:
        raise UserError(f"override '{item}' gives key '{exc.key}' twice; keep one") from None
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


def _reject_repeated_override(given: dict[str, str], item: str) -> None:
    """A key set twice on the command line (or a section set whole and one of its keys) is a mistake to point
    out, not a question of which one wins."""
    key = item.partition("=")[0]
    for other_key, other in given.items():
        if key == other_key or key.startswith(f"{other_key}.") or other_key.startswith(f"{key}."):
            repeated = min(key, other_key, key=len)
            raise UserError(f"config key '{repeated}' is set twice on the command line ('{other}' and '{item}'); "
                            f"give it once")
    given[key] = item


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
    if meta.get("choices") and value not in meta["choices"]:
        near = difflib.get_close_matches(str(value), meta["choices"], n=1)
        hint = f"; did you mean '{near[0]}'?" if near else ""
        raise UserError(f"config key '{key}' = {value!r} is not allowed; choose one of "
                        f"{', '.join(meta['choices'])}{hint}")
    _check_range(key, value, meta.get("min"), meta.get("max"))
    if isinstance(value, list):
        for i, item in enumerate(value):
            _check_range(f"{key}[{i}]", item, meta.get("item_min"), meta.get("item_max"))
    return value


def _check_range(key: str, value: Any, low, high) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise UserError(f"config key '{key}' = {value!r} must be a finite number")
    if low is not None and value < low:
        raise UserError(f"config key '{key}' = {value!r} is out of range; it must be >= {low}")
    if high is not None and value > high:
        raise UserError(f"config key '{key}' = {value!r} is out of range; it must be <= {high}")


def _type_name(kind) -> str:
    return getattr(kind, "__name__", None) or str(kind).replace("typing.", "")


def _integral_number(value: Any) -> int | None:
    """1e4 or 1.0e6 written for an integer key, when it is a whole number; None for anything else (1.5, 1e4.5).

    YAML 1.1 reads 1e4 and 1.0e6 (no dot, or no exponent sign) as strings and 1.0e+6 as a float.
    """
    if isinstance(value, str):
        try:
            return int(value)  # exact, however long
        except ValueError:
            pass
        try:
            value = float(value)
        except ValueError:
            return None
    if isinstance(value, float) and value.is_integer():  # False for inf and nan
        return int(value)
    return None


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
        if isinstance(value, bool):
            raise wrong
        if isinstance(value, int):
            return value
        number = _integral_number(value)
        if number is None:
            raise wrong
        return number
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


def describe_schema(cfg: Config | None = None) -> str:
    """Every section and key with its type, default and help line, for --help; the plug-in sections list the keys
    of the classes cfg selects (the defaults when cfg is None)."""
    if cfg is None:
        cfg = load_config()
    lines = []
    for section in dataclasses.fields(Config):
        if section.name == "classes":
            continue
        if section.name == "callbacks":
            lines.append("  callbacks: a list of module:Class (or {class: module:Class, ...its keys}), called on "
                         "trainers after every iteration")
            for i, (name, config) in enumerate(cfg.callbacks):
                lines += _describe_section(f"callbacks[{i}]", type(config), f"class {name}")
            continue
        if section.name in PLUGIN_SECTIONS:
            lines += _describe_section(section.name, type(getattr(cfg, section.name)),
                                       f"class {cfg.classes[section.name]}; set {section.name}.class to choose")
        else:
            lines += _describe_section(section.name, typing.get_type_hints(Config)[section.name])
    return "\n".join(lines)


def _describe_section(name: str, cls: type, note: str = "") -> list[str]:
    lines = [f"  {name}:" + (f"  ({note})" if note else "")]
    hints = typing.get_type_hints(cls)
    defaults = cls()
    for f in dataclasses.fields(cls):
        default = getattr(defaults, f.name)
        extra = ""
        if f.metadata.get("choices"):
            extra = f" [{'|'.join(f.metadata['choices'])}]"
        lines.append(f"    {name}.{f.name} ({_type_name(hints[f.name])}, default {default!r}){extra}: "
                     f"{f.metadata.get('help', '')}")
    return lines
