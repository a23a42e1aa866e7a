"""The docs name only what exists: every repository path and `python -m spmd_rl...` module that README.md and
docs/*.md name is there, and every config key they name (`section.key`) is a key of the core sections or of a
built-in plug-in's Config."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
from pathlib import Path

import pytest

from spmd_rl.config import plugins
from spmd_rl.config.sections import Config

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TOP = {path.name for path in ROOT.iterdir() if not path.name.startswith(".")} | {".ci"}
PACKAGE_FOLDERS = {path.name for path in (ROOT / "spmd_rl").iterdir() if path.is_dir()}

# What a doc shows as code: `inline` spans and fenced blocks.
CODE = re.compile(r"```.*?```|`[^`\n]+`", re.S)
PATH = re.compile(
    r"(?<![\w./~$<-])((?:\.ci|[A-Za-z_][\w-]*)(?:/[\w.*<>-]+)+/?|[A-Za-z_][\w-]*\.(?:py|sh|yaml|toml)(?![\w(]))"
)
MODULE = re.compile(r"-m\s+(spmd_rl(?:\.\w+)*)")
KEY = re.compile(r"(?<![\w./:$-])([a-z_]+)\.([a-z_]+)(?![\w(/-]|\.[a-z]{2,5}\b)")
# Paths a run or a user makes (run directories, a user's files), not the repository's.
NOT_IN_REPO = ("runs/", "checkpoints/", "buffer/", "iter_", "my_", "my.", "~", "/tmp", "<", "*", "...")
# Names that read like config keys: Run's attributes, TrainedRun's, a gymnasium env's step, a run directory's
# lock file, and docs/running.md's example of a mistyped key.
PYTHON_NAMES = {
    "run.plan",
    "run.role",
    "run.iterations",
    "run.end_iteration",
    "run.finished",
    "run.metrics",
    "env.step",
    "run.lock",  # a file of the run directory
    "train.totl_steps",  # docs/running.md's example of a typo in an override
}
EXTENSIONS = {"py", "pt", "yaml", "yml", "json", "jsonl", "h5", "md", "sh", "toml", "txt", "mp4", "png"}


def _code(doc: Path) -> str:
    return "\n".join(match.group(0) for match in CODE.finditer(doc.read_text()))


def _keys_of(section: str) -> set[str]:
    """Every key a section may hold: a core section's fields, or any built-in plug-in's (and `class`)."""
    field = {f.name: f for f in dataclasses.fields(Config)}[section]
    if section in plugins.KINDS:
        kind = plugins.KINDS[section]
        keys = {"class"}
        for name in kind.aliases:
            keys |= {f.name for f in dataclasses.fields(plugins.config_class(kind, name))}
        if section == "algo":  # the recurrent pair is named by its class path (no alias)
            for path in ("spmd_rl.algorithms.recurrent_ppo:RecurrentPPO",):
                keys |= {f.name for f in dataclasses.fields(plugins.config_class(kind, path))}
        if section == "policy":
            for path in ("spmd_rl.modules.recurrent:RecurrentActorCritic",):
                keys |= {f.name for f in dataclasses.fields(plugins.config_class(kind, path))}
        return keys
    factory = field.default_factory
    return {f.name for f in dataclasses.fields(factory())} if dataclasses.is_dataclass(factory) else set()


def _named_paths(doc: Path) -> set[str]:
    found = set()
    for match in PATH.finditer(doc.read_text()):
        path = match.group(1).rstrip(".,;:)")
        if any(part in path for part in NOT_IN_REPO) or path.startswith(("http", "www")):
            continue
        first = path.split("/", 1)[0]
        if "/" in path and first not in TOP | PACKAGE_FOLDERS:
            continue  # not a repository path (a module path, a metric like episode_return_mean/<group>, ...)
        found.add(path)
    return found


def _exists(path: str) -> bool:
    candidates = [ROOT / path, ROOT / "spmd_rl" / path]
    if "/" not in path:  # a bare file name: anywhere in the repository, as the docs say it in its folder's context
        return path.endswith(".yaml") or any(ROOT.glob(f"**/{path}"))  # a .yaml alone is a run's or a user's
    return any(candidate.exists() for candidate in candidates)


@pytest.mark.parametrize("doc", DOCS, ids=lambda doc: doc.name)
def test_every_path_a_doc_names_exists(doc):
    missing = sorted(path for path in _named_paths(doc) if not _exists(path))
    assert missing == [], f"{doc.name} names paths that do not exist"


@pytest.mark.parametrize("doc", DOCS, ids=lambda doc: doc.name)
def test_every_module_a_doc_runs_exists(doc):
    modules = set(MODULE.findall(doc.read_text()))
    missing = sorted(module for module in modules if importlib.util.find_spec(module) is None)
    assert missing == []


@pytest.mark.parametrize("doc", DOCS, ids=lambda doc: doc.name)
def test_every_config_key_a_doc_names_is_a_key(doc):
    sections = {f.name for f in dataclasses.fields(Config)} - {"classes", "callbacks"}
    unknown = set()
    for section, key in KEY.findall(_code(doc)):
        named = f"{section}.{key}"
        if section in sections and key not in EXTENSIONS and named not in PYTHON_NAMES and key not in _keys_of(section):
            unknown.add(named)
    assert sorted(unknown) == []


LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("doc", DOCS, ids=lambda doc: doc.name)
def test_every_link_a_doc_makes_lands(doc):
    broken = []
    for target in LINK.findall(doc.read_text()):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = target.partition("#")
        linked = (doc.parent / path).resolve() if path else doc
        if not linked.exists():
            broken.append(target)
        elif anchor and linked.suffix == ".md":
            headings = re.findall(r"^#+ (.*)$", linked.read_text(), re.M)
            if anchor not in {_anchor(heading) for heading in headings}:
                broken.append(target)
    assert broken == []


def _layer_rows() -> dict[str, str]:
    """docs/architecture.md's layers table: {folder (or "top"): the row's text}."""
    rows = {}
    for line in (ROOT / "docs" / "architecture.md").read_text().splitlines():
        match = re.match(r"\| \d+ \| (.*?) \| (.*) \|$", line)
        if match:
            for folder in re.findall(r"`(\w+)/`", match.group(1)) or [match.group(1)]:
                rows[folder] = match.group(2)
    return rows


def test_the_architecture_page_names_every_module_on_its_layers_row():
    rows = _layer_rows()
    unnamed = []
    for path in sorted((ROOT / "spmd_rl").rglob("*.py")):
        parts = path.relative_to(ROOT / "spmd_rl").parts
        if path.name != "__init__.py" and f"`{path.name}`" not in rows[parts[0] if len(parts) > 1 else "top"]:
            unnamed.append("/".join(parts))
    assert unnamed == [], "docs/architecture.md's layers table does not say where these modules live"


def test_the_architecture_pages_layers_are_the_ones_test_layers_enforces():
    from test_layers import LAYERS

    rows = _layer_rows()
    folders = {name for names in LAYERS[:-1] for name in names}
    assert set(rows) == folders | {"top"}
    top = {Path(name).stem for name in re.findall(r"`(\w+\.py)`", rows["top"])}
    assert top == LAYERS[-1]


def test_the_glossary_gives_each_word_one_row():
    page = (ROOT / "docs" / "architecture.md").read_text()
    section = page.split("\n## Words\n", 1)[1].split("\n## ", 1)[0]
    words = re.findall(r"^\| (\w+) \| ", section, re.MULTILINE)
    glossary = {"run", "iteration", "segment", "episode", "group", "checkpoint", "plan", "layout"}
    assert glossary <= set(words)
    assert len(words) == len(set(words))
