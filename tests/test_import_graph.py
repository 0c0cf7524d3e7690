"""The import graph of the three packages: no cycles, and no imports between project modules inside functions.

Importing ``a.b`` first runs ``a/__init__.py``: an import of a module in another package is also an edge to
that package's ``__init__`` (which is how ``pallas_kernels.reference -> qevict_jax.quant`` once closed a loop
through ``qevict_jax/__init__.py``).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("qevict_jax", "pallas_kernels", "models")


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = path
    return out


def _imports(tree: ast.AST, modules: dict[str, Path]) -> list[tuple[str, ast.AST]]:
    """Project modules named by every import statement in ``tree``: (module, node)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, node) for a in node.names if a.name in modules]
        elif isinstance(node, ast.ImportFrom) and node.module in modules:
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                found.append((sub if sub in modules else node.module, node))
    return found


def _ancestors(module: str) -> set[str]:
    """The packages whose ``__init__`` runs before ``module``: ``a.b.c`` -> {``a``, ``a.b``}."""
    parts = module.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def _graph() -> tuple[dict[str, set[str]], list[str]]:
    modules = _modules()
    edges: dict[str, set[str]] = {m: set() for m in modules}
    deferred = []
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        top_level = {id(n) for n in tree.body}
        own_packages = _ancestors(name)
        for target, node in _imports(tree, modules):
            if target == name:
                continue
            edges[name].add(target)
            edges[name] |= {a for a in _ancestors(target) if a in modules and a not in own_packages}
            if id(node) not in top_level:
                deferred.append(f"{name} -> {target} (line {node.lineno})")
    return edges, deferred


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_cycle_finder_finds_a_planted_cycle():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(edges) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_the_project_import_graph_has_no_cycles():
    edges, _ = _graph()
    assert len(edges) > 30  # every module of the three packages was read
    assert _cycles(edges) == []


def test_no_project_module_is_imported_inside_a_function():
    _, deferred = _graph()
    assert deferred == []
