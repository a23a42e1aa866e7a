"""The package's layering (docs/architecture.md): every import of a spmd_rl module, at module level or inside a
function, points to the same layer or a lower one, and the module-level imports form no cycle."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "spmd_rl"

# Lowest first. A module's layer is its folder's (or, at the top, its own name's).
LAYERS = [
    {"runtime"},
    {"config"},
    {"comm", "envs", "persist"},
    {"storage"},
    {"interfaces"},
    {"roles", "algorithms", "modules"},
    {"run"},
    {"engines"},
    {"main", "api", "evaluate", "plot", "runs", "data", "experience", "sweep", "collect"},
]


def _layer(module: str) -> int:
    part = module.split(".")[1]
    return next(i for i, names in enumerate(LAYERS) if part in names)


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        if name != "spmd_rl":
            found[name] = path
    return found


def _imports(path: Path, top_level_only: bool) -> set[str]:
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else ast.walk(tree)
    names = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("spmd_rl"):
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names if alias.name.startswith("spmd_rl"))
    return names


def test_every_import_points_to_the_same_layer_or_below():
    modules = _modules()
    upward = []
    for name, path in modules.items():
        for target in _imports(path, top_level_only=False):
            if target in modules and target != "spmd_rl" and _layer(target) > _layer(name):
                upward.append(f"{name} -> {target}")
    assert upward == []


def test_module_level_imports_form_no_cycle():
    modules = _modules()
    graph = {
        name: {t for t in _imports(path, top_level_only=True) if t in modules and t != name}
        for name, path in modules.items()
    }
    # A package's __init__ is imported with any of its modules: count an edge to a module as one to its package.
    for name in list(graph):
        graph[name] |= {t.rsplit(".", 1)[0] for t in graph[name] if t.rsplit(".", 1)[0] in modules}
        graph[name].discard(name)
    state: dict[str, int] = {}
    cycles = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1 and not node.startswith(nxt + "."):  # a module importing its own package is fine
                cycles.append(stack[stack.index(nxt) :] + [nxt] if nxt in stack else [node, nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert cycles == []


def test_a_module_over_400_lines_says_why_at_its_top():
    unexplained = []
    for path in _modules().values():
        text = path.read_text()
        relative = str(path.relative_to(PACKAGE))
        if text.count("\n") > 400:
            docstring = ast.get_docstring(ast.parse(text)) or ""
            if "Over 400 lines" not in docstring.replace("\n", " "):
                unexplained.append(relative)
    assert unexplained == [], "split these modules, or say at their top why they are over 400 lines"
