"""The shape the product code keeps (issue 27): modules under 400 lines, no public function with more than six
positional parameters (the rest are keyword-only), and a layer folder for every module of ``qevict_jax``."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("qevict_jax", "pallas_kernels", "models")
MAX_LINES = 400
MAX_POSITIONAL = 6
KNOWN: dict[str, str] = {
    # what is left, named so that it is not forgotten (each entry must still be needed: a test says so)
}


def _modules() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def too_long(paths: list[Path]) -> list[tuple[str, int]]:
    """Modules over ``MAX_LINES`` lines: (file name, lines)."""
    counts = [(path, len(path.read_text(encoding="utf-8").splitlines())) for path in paths]
    return [(str(path), n) for path, n in counts if n > MAX_LINES]


def too_many_positional(source: str) -> list[str]:
    """Public functions and methods of ``source`` with more than ``MAX_POSITIONAL`` positional parameters
    (``self`` and ``cls`` not counted): 'name:line (count)'."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and not node.name.startswith("_"):
            args = [a.arg for a in node.args.posonlyargs + node.args.args if a.arg not in ("self", "cls")]
            if len(args) > MAX_POSITIONAL:
                out.append(f"{node.name}:{node.lineno} ({len(args)})")
    return out


def test_the_checks_catch_planted_violations(tmp_path):
    planted = "def f(a, b, c, d, e, f, g):\n    pass\n\ndef g(a, b, c, d, e, f, *, g):\n    pass\n"
    planted += "class C:\n    def m(self, a, b, c, d, e, f):\n        pass\n\ndef _private(a, b, c, d, e, f, g):\n    pass\n"
    assert too_many_positional(planted) == ["f:1 (7)"]
    long = tmp_path / "long.py"
    long.write_text("x = 1\n" * (MAX_LINES + 1))
    short = tmp_path / "short.py"
    short.write_text("x = 1\n" * MAX_LINES)
    assert too_long([short, long]) == [(str(long), MAX_LINES + 1)]


def _found() -> set[str]:
    """Product modules over either limit, relative to the repository."""
    long = {str(Path(path).relative_to(ROOT)) for path, _ in too_long(_modules())}
    wide = {str(p.relative_to(ROOT)) for p in _modules() if too_many_positional(p.read_text(encoding="utf-8"))}
    return long | wide


def test_product_modules_keep_the_line_and_positional_limits():
    assert sorted(_found() - set(KNOWN)) == []


def test_every_known_exception_is_still_needed():
    assert sorted(set(KNOWN) - _found()) == []
