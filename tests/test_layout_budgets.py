"""Size budgets of the engine's rooms, read from ``src/`` with ``ast`` (nothing imported).

1. ``engine/``'s top level holds at most 15 modules: the round loop, the request edge,
   outputs, trace, config and ``build_engine``; the device side lives in ``engine/runner/``
   and worker processes in ``engine/remote/``.
2. No module imports more than 15 of the package's modules at run time (a module that
   needs more wires too much: split it, or let a builder below it do part of the wiring).
   Imports under ``if TYPE_CHECKING:`` name types only and are not counted.
3. No function or method in ``engine/`` or ``sched/`` is longer than 80 lines.

Each failure names the files, lines and counts involved.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.layout

SRC = Path(__file__).resolve().parents[1] / "src"
PKG = SRC / "deepinfer_kit"
MAX_TOP_ENGINE = 15
MAX_IMPORTED = 15
MAX_FUNCTION = 80


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def _runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node of ``tree`` outside ``if TYPE_CHECKING:`` blocks."""
    out: list[ast.AST] = []
    stack = [tree]
    while stack:
        node = stack.pop()
        out.append(node)
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and isinstance(child.test, ast.Name) and child.test.id == "TYPE_CHECKING":
                stack.extend(child.orelse)
                continue
            stack.append(child)
    return out


def _imported_modules(path: Path) -> set[str]:
    """The package's modules ``path`` imports at run time (``from a.b import c`` counts
    module ``a.b.c`` when it is one, else ``a.b``)."""
    found: set[str] = set()
    for node in _runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in MODULES}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                if sub in MODULES:
                    found.add(sub)
                elif node.module in MODULES:
                    found.add(node.module)
    return found


def test_engine_top_level_is_small() -> None:
    top = sorted(p.name for p in (PKG / "engine").glob("*.py"))
    assert len(top) <= MAX_TOP_ENGINE, f"engine/ holds {len(top)} modules (budget {MAX_TOP_ENGINE}): {top}"


def test_no_module_imports_too_many_package_modules() -> None:
    wide = {name: len(_imported_modules(path)) for name, path in MODULES.items()}
    over = {name: n for name, n in wide.items() if n > MAX_IMPORTED}
    assert not over, f"modules importing more than {MAX_IMPORTED} package modules: {over}"


def _long_functions(root: Path) -> list[str]:
    out = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > MAX_FUNCTION:
                    out.append(f"{path.relative_to(SRC)}:{node.lineno} {node.name} ({length} lines)")
    return out


@pytest.mark.parametrize("room", ["engine", "sched"])
def test_functions_fit_a_screen(room: str) -> None:
    long = _long_functions(PKG / room)
    assert not long, f"functions over {MAX_FUNCTION} lines: {long}"


def test_the_checks_see_what_they_measure() -> None:
    """Each rule's measure on a known case (so a rule that can no longer fail is caught)."""
    assert "deepinfer_kit.engine.engine" in _imported_modules(PKG / "engine" / "build.py")
    assert len(_imported_modules(PKG / "engine" / "build.py")) >= 5
    assert any("engine" in n for n in MODULES)
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import x\nimport y\n")
    names = {a.name for n in _runtime_nodes(tree) if isinstance(n, ast.Import) for a in n.names}
    assert names == {"y"}
