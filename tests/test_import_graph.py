"""The import graph of the three packages: no cycles, no imports between project modules inside functions, and
imports that point down the layers (``LAYERS``: an engine never imports a method, the runtime sees methods only
through their protocol).

Importing ``a.b`` first runs ``a/__init__.py``: an import of a module in another package is also an edge to
that package's ``__init__`` (which is how ``pallas_kernels.reference -> qevict_jax.quant`` once closed a loop
through ``qevict_jax/__init__.py``).
"""

from __future__ import annotations

import ast
import functools
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("qevict_jax", "pallas_kernels", "models")


@functools.cache
def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"))


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
        tree = _parse(path)
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


# ------------------------------------------------------------------------------------------------ layers

LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    # bottom first: a module may import its own layer and the layers before it, never one after it. An entry
    # ending in ``.*`` is a package and everything below it, so the folders are the layers; any other entry
    # is one module.
    ("models", ("models", "models.*")),
    ("kernels", ("pallas_kernels", "pallas_kernels.*")),
    # configuration, byte storage and accounting, the method protocol, the cache pytrees (Full-KV's included),
    # the budget solver, the leaves on a mesh
    ("core", ("qevict_jax.core", "qevict_jax.core.*")),
    # how important a window or token is: attention mass, the rankings, the learned gates' network
    ("rankings", ("qevict_jax.rankings", "qevict_jax.rankings.*")),
    # the window engine (plan and migrate, attend) and the token-pool engine
    ("engines", ("qevict_jax.engines", "qevict_jax.engines.*")),
    ("methods", ("qevict_jax.methods", "qevict_jax.methods.*")),
    # generation: sees methods only through the protocol (``RUNTIME_SEES_ONLY_THE_PROTOCOL``)
    ("runtime", ("qevict_jax.runtime", "qevict_jax.runtime.*")),
    # the one-import façade (methods by name from the registry, a model by name) and the package itself
    ("api", ("qevict_jax", "qevict_jax.pipeline", "qevict_jax.compressed", "qevict_jax.model_args")),
    ("eval", ("qevict_jax.eval", "qevict_jax.eval.*", "qevict_jax.diagnostics", "qevict_jax.diagnostics.*")),
    # gate training (reads the evaluation's prose as training text)
    ("training", ("qevict_jax.training", "qevict_jax.training.*")),
    ("cli", ("qevict_jax.cli", "qevict_jax.cli_ask", "qevict_jax.cli_train")),
)
"""Every module of the three packages in one layer, bottom first (docs/design.md §2)."""

RUNTIME_SEES_ONLY_THE_PROTOCOL = ("runtime",)
"""Layers above ``methods`` that may not import a methods-layer module nor a concrete method class (the
protocol ``kv.KVMethod`` is what they see)."""

EXCEPTIONS: dict[tuple[str, str], str] = {
    # (importer, imported module or name): a known violation, named here with why, until it is moved
}


def _layer_of() -> dict[str, int]:
    return _layer_of_modules(_modules())


def _layer_of_modules(modules: dict[str, Path]) -> dict[str, int]:
    """Each module's rank in ``LAYERS``; a module that no entry names is missing from the result."""
    out = {}
    for name in modules:
        ranks = {
            rank
            for rank, (_, entries) in enumerate(LAYERS)
            for e in entries
            if name == e or (e.endswith(".*") and name.startswith(e[:-1]))
        }
        assert len(ranks) <= 1, f"{name} is in two layers"
        if ranks:
            out[name] = ranks.pop()
    return out


def _import_edges() -> list[tuple[str, str, int, tuple[str, ...]]]:
    """(importer, imported module, line, names imported from it) for every import between project modules,
    with the package ``__init__`` an import of another package's module runs (``_ancestors``)."""
    modules = _modules()
    out = []
    for name, path in modules.items():
        tree = _parse(path)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [(a.name, ()) for a in node.names if a.name in modules]
            elif isinstance(node, ast.ImportFrom) and node.module in modules:
                subs = [f"{node.module}.{a.name}" for a in node.names]
                names = tuple(a.name for a, s in zip(node.names, subs, strict=True) if s not in modules)
                targets = [(s, ()) for s in subs if s in modules] + ([(node.module, names)] if names else [])
            else:
                continue
            for target, names in targets:
                if target == name:
                    continue
                out.append((name, target, node.lineno, names))
                for package in sorted(_ancestors(target) - _ancestors(name) - {name}):
                    if package in modules:
                        out.append((name, package, node.lineno, ()))
    return out


def _concrete_methods() -> set[str]:
    """Names of the classes that implement a KV method: they define ``decode_attend`` or inherit it from a
    project class that does (protocols excluded)."""
    bases: dict[str, list[str]] = {}
    defines: set[str] = set()
    protocols: set[str] = set()
    for path in _modules().values():
        for node in ast.walk(_parse(path)):
            if isinstance(node, ast.ClassDef):
                names = [b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases]
                bases[node.name] = names
                if "Protocol" in names:
                    protocols.add(node.name)
                if any(isinstance(f, ast.FunctionDef) and f.name == "decode_attend" for f in node.body):
                    defines.add(node.name)

    def concrete(cls: str, seen: frozenset = frozenset()) -> bool:
        if cls in defines:
            return True
        return any(concrete(b, seen | {cls}) for b in bases.get(cls, ()) if b in bases and b not in seen)

    return {c for c in bases if c not in protocols and concrete(c)}


def _layer_violations() -> list[str]:
    layer = _layer_of()
    names = [n for n, _ in LAYERS]
    methods_rank = names.index("methods")
    concrete = _concrete_methods()
    found = []
    for importer, target, line, imported in _import_edges():
        a, b = layer[importer], layer[target]
        where = f"{importer} (line {line})"
        if b > a and (importer, target) not in EXCEPTIONS:
            found.append(f"{where} imports {target}: layer {names[a]} imports the higher layer {names[b]}")
        below_methods = a < methods_rank
        protocol_only = names[a] in RUNTIME_SEES_ONLY_THE_PROTOCOL
        if protocol_only and b == methods_rank and (importer, target) not in EXCEPTIONS:
            found.append(f"{where} imports {target}: the {names[a]} sees methods only through the protocol")
        for n in imported:
            if n in concrete and (below_methods or protocol_only) and (importer, n) not in EXCEPTIONS:
                found.append(f"{where} imports the concrete method {n} from {target} (layer {names[a]})")
    return found


def test_every_module_has_one_layer():
    layer = _layer_of()
    modules = set(_modules())
    assert sorted(modules - set(layer)) == [], "modules without a layer: add them to LAYERS"
    matched = {e for _, entries in LAYERS for e in entries for m in modules if m == e or (e.endswith(".*") and m.startswith(e[:-1]))}
    assert sorted({e for _, entries in LAYERS for e in entries} - matched) == [], "LAYERS names modules that do not exist"
    # a new module directly in qevict_jax/ gets no layer: only the façade's modules are named one by one
    with_new = {**_modules(), "qevict_jax.helpers": ROOT / "qevict_jax" / "helpers.py"}
    assert "qevict_jax.helpers" not in _layer_of_modules(with_new)


def test_imports_point_down_the_layers():
    assert _layer_violations() == []


def test_every_layer_exception_is_still_needed():
    """An exception that no import needs any more is removed, so the list stays the list of what is left."""
    concrete = _concrete_methods()
    used = set()
    for importer, target, _, imported in _import_edges():
        used.add((importer, target))
        used |= {(importer, n) for n in imported if n in concrete}
    assert sorted(set(EXCEPTIONS) - used) == []


def test_layer_checks_catch_planted_violations(monkeypatch):
    """An engine importing a method, the runtime importing a concrete method or the registry: all caught."""
    planted = [
        ("qevict_jax.engines.window", "qevict_jax.methods.qevict", 1, ("WindowMethod",)),
        ("qevict_jax.runtime.decode", "qevict_jax.methods.full", 2, ("FullKV",)),
        ("qevict_jax.runtime.generate", "qevict_jax.methods.registry", 3, ("make_method",)),
        ("qevict_jax.core.config", "qevict_jax.rankings.scoring", 4, ("RANKINGS",)),
    ]
    monkeypatch.setattr(sys.modules[__name__], "_import_edges", lambda: planted)
    found = _layer_violations()
    # the engine's import is both a higher layer and a concrete method; the decode's both a methods-layer
    # module and a concrete method
    assert len(found) == 6, found
    assert any("qevict_jax.engines.window (line 1)" in f and "higher layer methods" in f for f in found)
    assert any("qevict_jax.engines.window (line 1) imports the concrete method WindowMethod" in f for f in found)
    assert any("qevict_jax.runtime.decode (line 2) imports the concrete method FullKV" in f for f in found)
    assert any("qevict_jax.runtime.generate (line 3)" in f and "only through the protocol" in f for f in found)
    assert any("qevict_jax.core.config (line 4)" in f and "higher layer rankings" in f for f in found)
    assert {"FullKV", "WindowMethod", "SnapKV", "PyramidKV", "GateQEvict"} <= _concrete_methods()
    assert "KVMethod" not in _concrete_methods() and "Fanout" not in _concrete_methods()
