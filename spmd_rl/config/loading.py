"""Loading the run's config: defaults <- a YAML file <- `a.b=value` overrides, each value checked against its
knob (type, range, choices), the plug-in sections built from the Config of the class they name; and --help's
listing of every key. Every failure is a UserError naming the key (main: exit 2).

Over 400 lines: the one path from YAML and overrides to a checked Config, with its input bounds; split, the
checks of one value would be spread over files.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import math
import re
import sys
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from spmd_rl.config import plugins
from spmd_rl.config.excerpts import MESSAGE_CHARS, clip, excerpt
from spmd_rl.config.sections import GROUP_NAME, PLUGIN_SECTIONS, AlgorithmConfig, Config, EnvSection
from spmd_rl.runtime.errors import UserError
from spmd_rl.runtime.launch import rank_from_env
from spmd_rl.runtime.watchdog import watchdog

# Bounds on what a user hands us, checked before anything grows with it (a YAML alias bomb, a huge or deeply nested
# file): each is an exit 2 naming the file or the key, found in well under a second.
MAX_CONFIG_BYTES = 1 << 20  # a config file, and each override
MAX_DEPTH = 64  # nesting of mappings and lists (a file, an override's value, an override's dotted key)
MAX_VALUES = 10_000  # values in a file or an override once its aliases (*name) are expanded
FLOAT32_MAX = 3.4028234663852886e38  # float knobs become float32 tensors: a larger value overflows there
INT64_RANGE = (-(2**63), 2**63 - 1)
MAX_INT_CHARS = 100  # a YAML integer written with more characters is out of range for every key
_LONG_INTEGER = re.compile(r"[+-]?[0-9][0-9_]{19,}")  # more digits than int64 has: out of range, whatever they are


def load_config(path: str | Path | None = None, overrides: Sequence[str] = (), only_policy: bool = False) -> Config:
    """Defaults <- YAML file <- `a.b=value` overrides, all validated.

    The defaults are the embedded default run (PPO on CartPole-v1, the same as configs/ppo_cartpole.yaml), so
    `python -m spmd_rl.main` needs no file. only_policy: for acting with a trained policy, the algorithm, engine
    and callback classes need not import (their sections are then left at their defaults, unchecked); the policy's
    must, and policy.class must be named.
    """
    raw = _read_yaml(Path(path)) if path is not None else {}
    given: dict[str, str] = {}
    for item in overrides:
        _apply_override(raw, item)
        _reject_repeated_override(given, item)
    source = Source(str(path) if path is not None else "the command line", given)
    for legacy, hint in (("model", "policy"), ("sac", "algo")):
        if legacy in raw:
            raise UserError(
                f"config section '{legacy}' (in {source}) was folded into '{hint}': move its keys under "
                f"'{hint}:' (see configs/)"
            )
    if "classes" in raw:  # bookkeeping of the plug-in sections, not a section of its own
        raise UserError(
            f"unknown config key 'classes' (in {source}); name a class with algo.class, policy.class, "
            f"engine.class or callbacks"
        )
    plugin_raw = {name: raw.pop(name) for name in (*PLUGIN_SECTIONS, "callbacks") if name in raw}
    cfg = _build(Config, raw, prefix="", source=source)
    _check_run_name(cfg.run.name)
    plugins.class_path(plugins.ENV_BACKEND, cfg.env.backend)  # an alias or module:Class (imported when used)
    check_env_groups(cfg.env, "env")
    check_env_groups(evaluation_env(cfg), "eval.env")
    if cfg.env.start_method != "auto" and cfg.env.vectorization != "async":
        raise UserError(
            f"env.start_method={cfg.env.start_method} says how async env workers start, but "
            f"env.vectorization={cfg.env.vectorization} starts none; set env.vectorization=async or drop "
            f"env.start_method"
        )
    if cfg.checkpoint.keep_best and not cfg.eval.every:
        raise UserError(
            "checkpoint.keep_best=true keeps the policy with the best evaluation, but eval.every=0 never evaluates; "
            "set eval.every (e.g. eval.every=10) or drop checkpoint.keep_best"
        )
    if cfg.eval.video_every and not cfg.eval.every:
        raise UserError(
            "eval.video_every records a video at every Nth evaluation, but eval.every=0 never evaluates; set "
            "eval.every (e.g. eval.every=10) or drop eval.video_every"
        )
    watchdog.rebound(cfg.dist.timeout_s)  # the plug-in imports below are bounded by the config's own bound
    _build_plugin_sections(cfg, plugin_raw, source, only_policy)
    return cfg


EVAL_ENV_KEYS = ("id", "kwargs", "groups")  # what eval.env may change: the settings, not how envs are run


def evaluation_env(cfg: Config) -> EnvSection:
    """The env section evaluation plays on: env with eval.env's keys replacing its own (a group list replaces
    the whole list; kwargs replace env.kwargs, and groups still merge theirs over them). Checked like env's keys."""
    changes = cfg.eval.env
    if not changes:
        return cfg.env
    for key in changes:
        if key not in EVAL_ENV_KEYS:
            raise UserError(
                f"unknown config key 'eval.env.{clip(str(key))}': eval.env may change {', '.join(EVAL_ENV_KEYS)} "
                f"(held-out settings); the rest of env applies as it is"
            )
    given = _build(EnvSection, changes, "eval.env.", Source("eval.env", {}))
    return dataclasses.replace(cfg.env, **{key: getattr(given, key) for key in changes})


def check_env_groups(env: EnvSection, where: str) -> None:
    """env.groups (or eval.env.groups): named, each name once, on a backend and vectorization that can mix ids."""
    if not env.groups:
        return
    seen = set()
    for i, group in enumerate(env.groups):
        if not re.fullmatch(GROUP_NAME, group.name):
            raise UserError(
                f"config key '{where}.groups[{i}].name' = {excerpt(group.name)} must be 1 to 40 letters, digits, "
                f"'_', '.' or '-' (it ends metric keys: episode_return_mean/<name>); give every group a name"
            )
        if group.name in seen:
            raise UserError(f"config key '{where}.groups[{i}].name': group '{group.name}' is named twice; rename one")
        seen.add(group.name)
    backend = plugins.load_class(plugins.ENV_BACKEND, env.backend)  # imported only for a config with groups
    if not getattr(backend, "takes_groups", True):
        raise UserError(
            f"{where}.groups needs env.backend=gymnasium: {backend.groups_refusal}; drop {where}.groups, or use "
            f"env.backend=gymnasium"
        )
    if env.vectorization == "vector_entry_point":
        raise UserError(
            f"{where}.groups mixes envs of several settings in one vector env: use env.vectorization=auto, sync or "
            f"async, not vector_entry_point"
        )


MAX_RUN_NAME = 100


def _check_run_name(name: str) -> None:
    """run.name becomes a directory under runs/: one plain path component, nothing that leaves runs/."""
    if not name or len(name) > MAX_RUN_NAME or "/" in name or "\\" in name or name in (".", "..") or "\0" in name:
        raise UserError(
            f"config key 'run.name' = {excerpt(name)} must be a plain name of 1 to {MAX_RUN_NAME} characters "
            f"without '/' or '\\' (it names a directory under runs/); use run.dir to choose another place"
        )


def _build_plugin_sections(cfg: Config, raw: dict, source: Source, only_policy: bool = False) -> None:
    """algo, policy, engine and callbacks: each names its class, whose own Config dataclass validates the rest.

    The algorithm is resolved first: an absent policy.class means the algorithm's default policy. With only_policy
    (and policy.class named), the other classes are not imported: see load_config."""

    def build(section: str, kind, value, default_class: str, prefix: str):
        if value is None:
            value = {}
        if isinstance(value, str):  # `callbacks: [pkg.mod:Cls]` and `engine: sync` name a class with no keys
            value = {"class": value}
        if not isinstance(value, dict):
            raise UserError(
                f"config key '{prefix.rstrip('.')}' must be a mapping with a 'class' key and the "
                f"class's own keys (in {source}), got {excerpt(value)}"
            )
        value = dict(value)
        name = value.pop("class", default_class)
        if not isinstance(name, str) or not name:
            raise UserError(
                f"config key '{prefix}class' must name a class (an alias or module:Class), got {excerpt(name)}"
            )
        config_cls = plugins.config_class(kind, name)
        return name, _build(config_cls, value, prefix, source.within(f"; keys of {kind.what} '{name}'"))

    algo_raw = raw.get("algo")
    policy_raw = raw.get("policy")
    if only_policy and isinstance(policy_raw, dict) and isinstance(policy_raw.get("class"), str):
        named = algo_raw.get("class", "ppo") if isinstance(algo_raw, dict) else "ppo"
        cfg.classes["algo"], cfg.algo = str(named), AlgorithmConfig()  # not needed to act; its module may be gone
        cfg.classes["policy"], cfg.policy = build("policy", plugins.POLICY, policy_raw, "", "policy.")
        cfg.classes["engine"], cfg.engine = "sync", None
        return
    if isinstance(algo_raw, dict) and "name" in algo_raw and "class" not in algo_raw:
        raise UserError(f"config key 'algo.name' (in {source}) is now 'algo.class' (ppo, sac or module:Class)")
    cfg.classes["algo"], cfg.algo = build("algo", plugins.ALGORITHM, algo_raw, "ppo", "algo.")
    if not isinstance(cfg.algo, AlgorithmConfig):
        raise UserError(
            f"algo.class '{cfg.classes['algo']}': its Config must subclass spmd_rl.api.AlgorithmConfig "
            f"(which gives every algorithm algo.num_steps)"
        )
    if "default_policy" in {f.name for f in dataclasses.fields(cfg.algo)}:
        raise UserError(
            f"algo.class '{cfg.classes['algo']}': its Config declares default_policy as a config key (algo."
            f'default_policy); declare it as a class attribute, `default_policy: ClassVar[str] = "module:Class"`'
        )
    default_policy = getattr(type(cfg.algo), "default_policy", "actor_critic")
    cfg.classes["policy"], cfg.policy = build("policy", plugins.POLICY, raw.get("policy"), default_policy, "policy.")
    cfg.classes["engine"], cfg.engine = build("engine", plugins.ENGINE, raw.get("engine"), "sync", "engine.")
    callbacks = raw.get("callbacks") or []
    if not isinstance(callbacks, list):
        raise UserError(f"config key 'callbacks' must be a list of classes (module:Class), got {excerpt(callbacks)}")
    cfg.callbacks = [
        build("callbacks", plugins.CALLBACK, item, "", f"callbacks[{i}].") for i, item in enumerate(callbacks)
    ]


class _DuplicateKeyError(yaml.YAMLError):
    def __init__(self, key: str, first_line: int, line: int):
        super().__init__(f"key '{key}' appears twice (lines {first_line} and {line})")
        self.key, self.first_line, self.line = key, first_line, line


class _TooLarge(yaml.YAMLError):
    """YAML past one of the bounds (MAX_DEPTH, MAX_VALUES, an integer's digits), found before it is built."""

    def __init__(self, problem: str, mark=None):
        super().__init__(problem)
        self.problem, self.problem_mark = problem, mark


class ConfigLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that a key given twice in one mapping is an error instead of last-one-wins, and
    that nothing grows without bound: nesting deeper than MAX_DEPTH, more than MAX_VALUES values once aliases are
    expanded (the "billion laughs" of YAML) and integers of more digits than any key needs are refused while the
    document is composed, before a single value is built."""

    _depth = 0
    _nodes = 0

    def compose_node(self, parent, index):
        self._nodes += 1  # an alias counts once here; _check_expansion counts what it repeats
        if self._nodes > MAX_VALUES:
            raise _TooLarge(f"the config holds more than {MAX_VALUES} values", self.peek_event().start_mark)
        return super().compose_node(parent, index)

    def compose_sequence_node(self, anchor):
        with self._nested():
            return super().compose_sequence_node(anchor)

    def compose_mapping_node(self, anchor):
        with self._nested():
            return super().compose_mapping_node(anchor)

    @contextlib.contextmanager
    def _nested(self):
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise _TooLarge(f"a value is nested deeper than {MAX_DEPTH} levels", self.peek_event().start_mark)
            yield
        finally:
            self._depth -= 1

    def construct_document(self, node):
        self._check_expansion(node, 1, {}, set())
        self._reject_duplicate_keys(node, "", set())
        return super().construct_document(node)

    def _check_expansion(self, node, depth: int, known: dict, open_nodes: set) -> tuple[int, int]:
        """(values, levels) of node with its aliases expanded; a _TooLarge past MAX_VALUES or MAX_DEPTH levels, or
        for an alias inside the node it names. Each node is counted once (known), so this is linear in the text."""
        if id(node) in known:
            count, levels = known[id(node)]
        elif id(node) in open_nodes:
            raise _TooLarge("an alias (*name) refers to a node that contains it", node.start_mark)
        else:
            if isinstance(node, yaml.SequenceNode):
                children = node.value
            elif isinstance(node, yaml.MappingNode):
                children = [child for pair in node.value for child in pair]
            else:
                children = []
            open_nodes.add(id(node))
            count, levels = 1, 0
            for child in children:
                child_count, child_levels = self._check_expansion(child, depth + 1, known, open_nodes)
                count, levels = count + child_count, max(levels, child_levels)
                if count > MAX_VALUES:
                    raise _TooLarge(
                        f"a value holds more than {MAX_VALUES} values once its aliases (*name) are expanded",
                        node.start_mark,
                    )
            open_nodes.discard(id(node))
            levels += bool(children)
            known[id(node)] = count, levels
        if depth + levels > MAX_DEPTH + 1:
            raise _TooLarge(
                f"a value is nested deeper than {MAX_DEPTH} levels once its aliases are expanded", node.start_mark
            )
        return count, levels

    def construct_yaml_int(self, node):
        text = self.construct_scalar(node)
        if len(text) > MAX_INT_CHARS:  # int64 needs 19 digits (64 in binary); int() of 5000 digits raises
            raise _TooLarge(
                f"the integer {excerpt(text)} is out of range (no key takes more than a 64-bit integer)",
                node.start_mark,
            )
        # YAML 1.2's integers, not 1.1's: a leading zero is decimal (064 is 64, not octal 52) and 1:30 is text (not
        # base-60 90; the key's type check then says what it wants).
        if ":" in text:
            return text
        digits = text.replace("_", "")
        if re.fullmatch(r"[-+]?0[0-9]+", digits):
            return int(digits, 10)
        return super().construct_yaml_int(node)

    def construct_yaml_bool(self, node):
        value = super().construct_yaml_bool(node)
        if node.value.lower() in YAML_11_BOOLS:  # text in YAML 1.2: worth a note, since it may have meant the word
            _bool_notes.append((node.value, value, node.start_mark.line + 1))
        return value

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


ConfigLoader.add_constructor("tag:yaml.org,2002:int", ConfigLoader.construct_yaml_int)
ConfigLoader.add_constructor("tag:yaml.org,2002:bool", ConfigLoader.construct_yaml_bool)

YAML_11_BOOLS = ("yes", "no", "on", "off")
_bool_notes: list[tuple[str, bool, int]] = []  # (the text, the value, its line) of the document being read


def _load_yaml(text: str, where: str):
    """yaml.load with ConfigLoader; a note (rank 0's) for every yes/no/on/off it read as a boolean."""
    _bool_notes.clear()
    data = yaml.load(text, Loader=ConfigLoader)
    if rank_from_env() in (None, 0):
        for word, value, line in _bool_notes:
            at = f"{where} line {line}" if where.startswith("config file") else where
            print(
                f"spmd_rl: note: {at}: '{word}' is read as {str(value).lower()} (YAML 1.1's booleans yes/no/on/off); "
                f"write {str(value).lower()} to say so, or quote it ('{word}') for the text",
                file=sys.stderr,
                flush=True,
            )
    return data


def _read_yaml(path: Path) -> dict:
    if path.is_dir():
        raise UserError(f"config file {path} is a directory; pass --config with a YAML file (see configs/)")
    if path.exists() and not path.is_file():
        raise UserError(
            f"config file {path} is not a regular file (a device, FIFO or socket); pass --config with a YAML file "
            f"(see configs/)"
        )
    if not path.is_file():
        raise UserError(f"config file {path} does not exist; pass --config with a YAML file (see configs/)")
    try:
        with open(path, "rb") as file:
            data = file.read(MAX_CONFIG_BYTES + 1)
        if len(data) > MAX_CONFIG_BYTES:
            raise UserError(
                f"config file {path} is larger than {MAX_CONFIG_BYTES >> 20} MiB; a config needs a few KiB (is it "
                f"the right file?)"
            )
        text = data.decode()
    except OSError as exc:
        raise UserError(f"config file {path} cannot be read ({exc.strerror}); check its permissions") from None
    except UnicodeDecodeError:
        raise UserError(f"config file {path} is not text (not UTF-8); pass --config with a YAML file") from None
    try:
        data = _load_yaml(text, f"config file {path}")
    except _DuplicateKeyError as exc:
        raise UserError(
            f"config file {path} gives key '{exc.key}' twice (lines {exc.first_line} and {exc.line}); keep one"
        ) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        if isinstance(exc, _TooLarge):
            raise UserError(f"config file {path}{where}: {problem}") from None
        raise UserError(f"config file {path} is not valid YAML{where}: {clip(problem, MESSAGE_CHARS)}") from None
    if data is None:  # nothing but comments, or nothing at all: probably the wrong file
        raise UserError(
            f"config file {path} is empty; give it sections (see configs/), or leave out --config to run the defaults"
        )
    if not isinstance(data, dict):
        raise UserError(
            f"config file {path} must hold a mapping of sections (run:, env:, algo:, ...), not a {type(data).__name__}"
        )
    _refuse_glued_key(data, f"config file {path}")
    return data


def _apply_override(raw: dict, item: str) -> None:
    key, sep, text = item.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise UserError(f"override {excerpt(item)} must look like section.key=value (e.g. train.total_steps=50000)")
    shown = clip(key)
    if len(item.encode()) > MAX_CONFIG_BYTES:
        raise UserError(f"config key '{shown}': its override is larger than {MAX_CONFIG_BYTES >> 20} MiB")
    parts = key.split(".")
    if len(parts) > MAX_DEPTH:
        raise UserError(f"config key '{shown}' is nested deeper than {MAX_DEPTH} levels")
    try:
        value = _load_yaml(text, f"override {excerpt(item)}") if text != "" else ""
    except _DuplicateKeyError as exc:
        raise UserError(f"override {excerpt(item)} gives key '{exc.key}' twice; keep one") from None
    except _TooLarge as exc:
        raise UserError(f"config key '{shown}' (on the command line): {exc.problem}") from None
    except yaml.YAMLError:
        value = text  # not YAML: keep the literal text, the type check below judges it
    _refuse_glued_key(value, f"override {excerpt(item)}", example_key=shown)
    node = raw
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise UserError(f"override {excerpt(item)}: {excerpt(part)} is not a section")
        node = child
    node[parts[-1]] = value


def _refuse_glued_key(value: Any, where: str, example_key: str = "") -> None:
    """A UserError with the fix when value holds a key like 'chunk:4' with no value (see _glued_key); example_key:
    the override's key, for an example of the whole override."""
    glued = _glued_key(value)
    if glued is None:
        return
    name, _, given = glued.partition(":")
    example = f", e.g. {example_key}={{{clip(name)}: {clip(given)}}}" if example_key else ""
    raise UserError(
        f"{where}: YAML reads '{clip(glued)}' as one key with no value (a colon needs a space after it); write "
        f"{clip(name)}: {clip(given)}{example}"
    )


def _glued_key(value: Any) -> str | None:
    """The first mapping key like 'chunk:4' with no value in value: `{chunk:4}` on a command line or in a file,
    which YAML reads as the key 'chunk:4' (a colon without a space after it is part of the text)."""
    if isinstance(value, dict):
        for key, item in value.items():
            if item is None and isinstance(key, str) and ":" in key.strip(":"):
                return key
            found = _glued_key(item)
            if found is not None:
                return found
    elif isinstance(value, list):
        return next((found for item in value if (found := _glued_key(item)) is not None), None)
    return None


@dataclasses.dataclass(frozen=True)
class Source:
    """Where a config's keys come from: a file (or 'the command line' without one) and the overrides given on top
    of it, so that a key is blamed on the override that brought it, not on the file."""

    path: str
    overrides: dict  # dotted key -> the override item that set it ('train.total_steps=5')
    within_class: str = ""  # '; keys of algorithm 'ppo'': a plug-in section's keys

    def __str__(self) -> str:
        return f"{self.path}{self.within_class}"

    def of(self, key: str) -> str:
        """'in FILE' or, when an override set this key, a section holding it or a key inside it, 'in the override
        ITEM'."""
        for given, item in self.overrides.items():
            if key == given or key.startswith(f"{given}.") or given.startswith(f"{key}."):
                return f"in the override {excerpt(item)}{self.within_class}"
        return f"in {self}"

    def within(self, within_class: str) -> Source:
        return dataclasses.replace(self, within_class=within_class)


def _reject_repeated_override(given: dict[str, str], item: str) -> None:
    """A key set twice on the command line (or a section set whole and one of its keys) is a mistake to point
    out, not a question of which one wins."""
    key = item.partition("=")[0]
    for other_key, other in given.items():
        if key == other_key or key.startswith(f"{other_key}.") or other_key.startswith(f"{key}."):
            repeated = min(key, other_key, key=len)
            raise UserError(
                f"config key '{repeated}' is set twice on the command line ({excerpt(other)} and {excerpt(item)}); "
                f"give it once"
            )
    given[key] = item


def _build(cls, raw: Any, prefix: str, source: Source):
    where = prefix.rstrip(".") or "the top level"
    if not isinstance(raw, dict):
        raise UserError(f"config key '{where}' must be a mapping of keys, got {excerpt(raw)}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    for key in raw:
        if key not in fields:
            name = clip(f"{prefix}{key}")
            allowed = sorted(f"{prefix}{k}" for k in fields)
            near = difflib.get_close_matches(name, allowed, n=1, cutoff=0.6)
            hint = f"; did you mean '{near[0]}'?" if near else f"; valid keys: {', '.join(allowed)}"
            raise UserError(f"unknown config key '{name}' ({source.of(f'{prefix}{key}')}){hint}")
    values = {}
    for name, f in fields.items():
        if name not in raw:
            continue
        kind = hints[name]
        if dataclasses.is_dataclass(kind):
            values[name] = _build(kind, raw[name], f"{prefix}{name}.", source)
        elif _is_list_of_sections(kind):
            values[name] = _build_list(typing.get_args(kind)[0], raw[name], f"{prefix}{name}", source)
        elif not _supported_type(kind):
            raise UserError(
                f"config key '{prefix}{name}' (in {source}) is declared as {_type_name(kind)}, which a config "
                f"cannot check; its class must declare it as {SUPPORTED_TYPES}"
            )
        else:
            values[name] = _check_value(f"{prefix}{name}", raw[name], kind, f.metadata)
    return cls(**values)


def _is_list_of_sections(kind) -> bool:
    return typing.get_origin(kind) is list and dataclasses.is_dataclass(typing.get_args(kind)[0])


def _build_list(cls, raw: Any, key: str, source: Source) -> list:
    """A list of mappings, each built and checked as a section of its own (env.groups)."""
    if not isinstance(raw, list):
        raise UserError(f"config key '{key}' must be a list of mappings (in {source}), got {excerpt(raw)}")
    return [_build(cls, item, f"{key}[{i}].", source) for i, item in enumerate(raw)]


def _check_value(key: str, value: Any, kind, meta) -> Any:
    value = _check_type(key, value, kind)
    if value is None:
        return value
    if meta.get("choices") and value not in meta["choices"]:
        same_letters = [choice for choice in meta["choices"] if str(choice).lower() == str(value).lower()]
        near = same_letters or difflib.get_close_matches(str(value), meta["choices"], n=1)  # 'FSDP': 'fsdp
        hint = f"; did you mean '{near[0]}'?" if near else ""
        raise UserError(
            f"config key '{key}' = {excerpt(value)} is not allowed; choose one of {', '.join(meta['choices'])}{hint}"
        )
    _check_range(key, value, meta.get("min"), meta.get("max"))
    if isinstance(value, list):
        for i, item in enumerate(value):
            _check_range(f"{key}[{i}]", item, meta.get("item_min"), meta.get("item_max"))
    return value


def _check_range(key: str, value: Any, low, high) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise UserError(f"config key '{key}' = {excerpt(value)} must be a finite number")
    if low is not None and value < low:
        raise UserError(f"config key '{key}' = {excerpt(value)} is out of range; it must be >= {low}")
    if high is not None and value > high:
        raise UserError(f"config key '{key}' = {excerpt(value)} is out of range; it must be <= {high}")
    # Beyond a knob's own range: what overflows where the value is used (int64 counters, float32 tensors).
    if isinstance(value, float) and abs(value) > FLOAT32_MAX:
        raise UserError(
            f"config key '{key}' = {excerpt(value)} is out of range; it must be within +-{FLOAT32_MAX:.3g} (it is "
            f"used as a 32-bit float)"
        )
    if isinstance(value, int) and not isinstance(value, bool) and not INT64_RANGE[0] <= value <= INT64_RANGE[1]:
        raise UserError(f"config key '{key}' = {excerpt(value)} is out of range; it must fit in a 64-bit integer")


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


SUPPORTED_TYPES = "bool, int, float, str, dict, list[T] (T one of bool, int, float, str) or any of them | None"


def _supported_type(kind) -> bool:
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        return len(rest) == 1 and len(args) == 2 and _supported_type(rest[0])
    if origin is list:
        return len(args) == 1 and args[0] in (bool, int, float, str)
    return kind in (bool, int, float, str, dict)


def _check_type(key: str, value: Any, kind) -> Any:
    origin = typing.get_origin(kind)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(kind)
        if value is None and type(None) in options:
            return None
        (inner,) = [o for o in options if o is not type(None)]
        return _check_type(key, value, inner)
    wrong = UserError(f"config key '{key}' must be {_type_name(kind)}, got {excerpt(value)} ({type(value).__name__})")
    if kind is bool:
        if not isinstance(value, bool):
            raise wrong
        return value
    if kind is int:
        if isinstance(value, bool):
            raise wrong
        if isinstance(value, int):
            return value
        if isinstance(value, str) and _LONG_INTEGER.fullmatch(value.strip()):
            raise UserError(f"config key '{key}' = {excerpt(value)} is out of range; it must fit in a 64-bit integer")
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
            lines.append(
                "  callbacks: a list of module:Class (or {class: module:Class, ...its keys}), called on "
                "trainers after every iteration"
            )
            for i, (name, config) in enumerate(cfg.callbacks):
                lines += _describe_section(f"callbacks[{i}]", type(config), f"class {name}")
            continue
        if section.name in PLUGIN_SECTIONS:
            lines += _describe_section(
                section.name,
                type(getattr(cfg, section.name)),
                f"class {cfg.classes[section.name]}; set {section.name}.class to choose",
            )
        else:
            lines += _describe_section(section.name, typing.get_type_hints(Config)[section.name])
    return "\n".join(lines)


def _describe_section(name: str, cls: type, note: str = "") -> list[str]:
    return [f"  {name}:" + (f"  ({note})" if note else ""), *_describe_keys(name, cls)]


def _describe_keys(prefix: str, cls: type) -> list[str]:
    """One line per key; a key that is a section of its own (policy.lora) as one line per key inside it."""
    lines = []
    hints = typing.get_type_hints(cls)
    defaults = cls()
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            lines += _describe_keys(f"{prefix}.{f.name}", hints[f.name])
            continue
        default = getattr(defaults, f.name)
        extra = ""
        if f.metadata.get("choices"):
            extra = f" [{'|'.join(f.metadata['choices'])}]"
        lines.append(
            f"    {prefix}.{f.name} ({_type_name(hints[f.name])}, default {default!r}){extra}: "
            f"{f.metadata.get('help', '')}"
        )
    return lines


class OneConfig(argparse.Action):
    """argparse's action for `--config`, given once: a second one silently replaced the first (fault pass 8, N4),
    where a user may expect the two merged."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        if getattr(namespace, self.dest, None) is not None:
            parser.error(
                f"--config given twice ({getattr(namespace, self.dest)}, then {values}): configs are not merged; "
                f"give one file and change its keys with section.key=value"
            )
        setattr(namespace, self.dest, values)
