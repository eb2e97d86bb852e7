"""House rules of the source tree, read from ``src/`` with ``ast`` (nothing is imported).

1. **Size.** No ``.py`` file under ``src/`` is longer than 400 lines; a file that grows
   past that holds two jobs.

2. **Private names stay private.** A name with a single leading underscore (``_x``, not a
   dunder such as ``__version__``) is private to the module that defines it, so no module
   imports one from another: ``from deepinfer_kit.sched.base import _will_fork`` breaks
   the rule, in any scope (module level, inside a function, under ``TYPE_CHECKING``) and in
   the relative forms (``from .base import _will_fork``, ``from . import _helper`` when
   ``_helper`` is a name of the package rather than a submodule). The rule is about
   *names*, not *modules*: a private module (``_kernels.py``, ``_validators.py``,
   ``cache/_index_base.py``, ``_dtypes.py``) is the package's internal API, and importing
   it (``import deepinfer_kit._kernels``, ``from deepinfer_kit import _kernels``) or its
   public names (``from deepinfer_kit._kernels import Impl``) is allowed. Binding a public
   name to a private alias (``from x import State as _State``) is allowed too: nothing
   private crosses a module boundary. Imports from outside the project are not checked.

3. **No import cycle among the modules of ``src/``.** Edges are read from every
   ``import`` and ``from ... import`` in a module, at any depth (function-local imports
   count: they form a cycle as soon as the function runs), except those inside an
   ``if TYPE_CHECKING:`` block, which never run; a cycle through such imports is fine.
   What an import statement points at:

   - ``import a.b.c`` and ``from a.b.c import name`` point at module ``a.b.c`` only, not
     at its parent packages. Python does run ``a/__init__`` and ``a/b/__init__`` first,
     but while a parent package's ``__init__`` imports its children it is already in
     ``sys.modules``, so a child reaching a sibling through the full dotted path
     (``from deepinfer_kit.cache.records import CacheConfig`` inside ``cache/``) is safe
     and is not reported as a cycle with the parent.
   - ``from a.b import c`` points at the submodule ``a.b.c`` when ``c`` is a module (a
     ``c.py`` or ``c/__init__.py`` exists), else at the package ``a.b`` itself (``c`` is a
     name that ``a/b/__init__.py`` defines or re-exports).
   - So a package's re-exports are edges from the package to its submodules, and a child
     that imports a re-exported name through its own package
     (``from deepinfer_kit.cache import CacheConfig`` inside ``cache/manager.py``) is a
     real cycle (it sees a half-initialised package) and is reported.

   Names resolved lazily through ``importlib.import_module`` (PEP 562 ``__getattr__``)
   are not edges: they run only on first use, after every module has loaded.

Each failure names the files, lines and names involved. The rule tests carry the
``layout`` marker and run in the default suite; they are never xfailed, so while a rewrite
still breaks a rule the failure is the list of what is left to fix.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest

pytestmark = pytest.mark.layout

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "deepinfer_kit"
MAX_LINES = 400


@attrs.frozen
class Module:
    name: str  # dotted, e.g. "deepinfer_kit.cache.manager"
    path: Path
    is_package: bool  # an __init__.py

    @property
    def rel(self) -> str:
        return self.path.relative_to(SRC.parent).as_posix()


@attrs.frozen
class ImportRef:
    """One imported name: ``from module import name`` (``name`` None for ``import module``)."""

    module: str  # absolute dotted module named by the statement
    name: str | None
    line: int
    type_checking_only: bool


def _modules() -> dict[str, Module]:
    found: dict[str, Module] = {}
    for path in sorted((SRC / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        found[".".join(parts)] = Module(".".join(parts), path, is_package)
    return found


MODULES = _modules()


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _walk(node: ast.AST, type_checking: bool) -> Iterator[tuple[ast.AST, bool]]:
    """Every node below ``node``, with whether it sits under ``if TYPE_CHECKING:``."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            yield child, type_checking
            for stmt in child.body:
                yield stmt, True
                yield from _walk(stmt, True)
            for stmt in child.orelse:
                yield stmt, type_checking
                yield from _walk(stmt, type_checking)
        else:
            yield child, type_checking
            yield from _walk(child, type_checking)


def _absolute(module: Module, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    package = module.name.split(".")
    if not module.is_package:
        package.pop()
    if node.level > 1:
        package = package[: len(package) - (node.level - 1)]
    return ".".join(package + ([node.module] if node.module else []))


def _imports(module: Module) -> list[ImportRef]:
    tree = ast.parse(module.path.read_text(), filename=str(module.path))
    refs: list[ImportRef] = []
    for node, tc in _walk(tree, False):
        if isinstance(node, ast.Import):
            refs.extend(ImportRef(a.name, None, node.lineno, tc) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(module, node)
            refs.extend(ImportRef(base, a.name, node.lineno, tc) for a in node.names)
    return refs


IMPORTS = {name: _imports(m) for name, m in MODULES.items()}


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _target(ref: ImportRef) -> str | None:
    """The project module an import points at (see the module docstring), or None."""
    if ref.module != PACKAGE and not ref.module.startswith(PACKAGE + "."):
        return None
    if ref.name is not None and f"{ref.module}.{ref.name}" in MODULES:
        return f"{ref.module}.{ref.name}"
    module = ref.module
    while module and module not in MODULES:  # a name that is not a file: nearest module
        module = module.rpartition(".")[0]
    return module or None


def test_no_source_file_is_over_the_line_budget() -> None:
    long = {
        m.rel: n
        for m in MODULES.values()
        if (n := len(m.path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"files over {MAX_LINES} lines (split the second job out): " + ", ".join(
        f"{path} ({n} lines)" for path, n in sorted(long.items())
    )


def test_no_private_name_is_imported_from_another_module() -> None:
    bad = [
        f"{MODULES[name].rel}:{ref.line} imports {ref.name!r} from {ref.module}"
        for name, refs in IMPORTS.items()
        for ref in refs
        if ref.name is not None
        and _is_private(ref.name)
        and (ref.module == PACKAGE or ref.module.startswith(PACKAGE + "."))
        and f"{ref.module}.{ref.name}" not in MODULES  # a private module is allowed
    ]
    assert not bad, "private names imported across modules:\n  " + "\n  ".join(bad)


def _graph() -> dict[str, dict[str, int]]:
    """module -> {imported module: first line}, runtime imports only."""
    graph: dict[str, dict[str, int]] = {name: {} for name in MODULES}
    for name, refs in IMPORTS.items():
        for ref in refs:
            target = _target(ref)
            if target is None or ref.type_checking_only or target == name:
                continue
            graph[name].setdefault(target, ref.line)
    return graph


def _components(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module, each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan; the graph is a few hundred nodes
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(components)


def _cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One shortest cycle through each strongly connected component of size > 1."""
    cycles = []
    for component in _components(graph):
        members = set(component)
        start = component[0]
        # Breadth-first from start back to start, inside the component.
        paths = {w: [start, w] for w in graph[start] if w in members}
        frontier = list(paths)
        while start not in paths:
            nxt = []
            for v in frontier:
                for w in sorted(graph[v]):
                    if w in members and w not in paths:
                        paths[w] = paths[v] + [w]
                        nxt.append(w)
            frontier = nxt
        cycles.append(paths[start])
    return cycles


def test_no_import_cycle() -> None:
    graph = _graph()
    cycles = _cycles(graph)
    described = []
    for cycle, component in zip(cycles, _components(graph)):
        hops = [
            f"{MODULES[a].rel}:{graph[a][b]} imports {b}" for a, b in zip(cycle, cycle[1:])
        ]
        more = sorted(set(component) - set(cycle))
        also = f"\n    (same cycle group: {', '.join(MODULES[m].rel for m in more)})" if more else ""
        described.append(" -> ".join(cycle) + "\n    " + "\n    ".join(hops) + also)
    assert not cycles, "import cycles (runtime imports, TYPE_CHECKING-only ones excluded):\n  " + (
        "\n  ".join(described)
    )


# The checker checks itself on small sources, so a rule that silently passes is caught.


def test_rules_see_function_local_relative_and_type_checking_imports() -> None:
    pkg = Module("deepinfer_kit.cache", SRC / PACKAGE / "cache" / "__init__.py", True)
    child = Module("deepinfer_kit.cache.manager", SRC / PACKAGE / "cache" / "manager.py", False)
    tree = ast.parse(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from deepinfer_kit.engine.engine import Engine\n"
        "else:\n"
        "    from deepinfer_kit import errors\n"
        "def f():\n"
        "    from .records import _hidden\n"
        "    from . import _index_base\n"
        "    from .. import _kernels\n"
    )
    refs = [
        ImportRef(_absolute(child, n), a.name, n.lineno, tc)
        for n, tc in _walk(tree, False)
        if isinstance(n, ast.ImportFrom)
        for a in n.names
    ]
    got = {(r.module, r.name, r.type_checking_only) for r in refs}
    assert ("deepinfer_kit.engine.engine", "Engine", True) in got
    assert ("deepinfer_kit", "errors", False) in got
    assert ("deepinfer_kit.cache.records", "_hidden", False) in got
    assert ("deepinfer_kit.cache", "_index_base", False) in got
    assert ("deepinfer_kit", "_kernels", False) in got
    assert _absolute(pkg, ast.parse("from .records import X").body[0]) == (  # type: ignore[arg-type]
        "deepinfer_kit.cache.records"
    )
    assert _target(ImportRef("deepinfer_kit.cache", "_index_base", 1, False)) == (
        "deepinfer_kit.cache._index_base"
    )
    assert _target(ImportRef("deepinfer_kit.cache", "CacheConfig", 1, False)) == "deepinfer_kit.cache"
    assert _target(ImportRef("torch", "nn", 1, False)) is None


def test_cycle_finder_reports_a_cycle_and_ignores_a_dag() -> None:
    assert _cycles({"a": {"b": 1}, "b": {"c": 1}, "c": {}}) == []
    assert _cycles({"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3}, "d": {"a": 1}}) == [
        ["a", "b", "c", "a"]
    ]
