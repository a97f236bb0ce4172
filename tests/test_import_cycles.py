"""No import cycle in the package: module-level imports point one way, those under ``TYPE_CHECKING``
included (an AST scan). Imports inside functions are deferred on purpose (heavy optional dependencies),
never to dodge a cycle: counted too, the package still has none. In ``hf/`` the trainer kinds' adapters
sit between the shared core and the entry points, and no adapter imports another."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "smart_batching"


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _module_level(tree: ast.Module) -> list[ast.stmt]:
    """Statements that run at import time: the module's own, and those nested in its ``if`` / ``try``
    / ``with`` blocks (``if TYPE_CHECKING:`` too), not those in function or class bodies."""
    out, todo = [], list(tree.body)
    while todo:
        node = todo.pop()
        out.append(node)
        if isinstance(node, ast.If | ast.Try | ast.With):
            for field in ("body", "orelse", "finalbody", "handlers"):
                for child in getattr(node, field, []):
                    todo.extend(child.body if isinstance(child, ast.ExceptHandler) else [child])
    return out


def _everywhere(tree: ast.Module) -> list[ast.AST]:
    """Every statement, those in function and class bodies included."""
    return list(ast.walk(tree))


def import_graph(root: Path = SRC, package: str = PACKAGE, *, deferred: bool = False) -> dict[str, set[str]]:
    """``{module: modules of the package it imports at module level}`` (``deferred``: anywhere, inside
    functions too)."""
    files = {_module_name(p, root): p for p in (root / package).rglob("*.py")}
    statements = _everywhere if deferred else _module_level
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        is_package = path.name == "__init__.py"
        edges = set()
        for node in statements(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: from the package this module is in (or is)
                    base = name.split(".")
                    base = base[: len(base) - node.level + (1 if is_package else 0)]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                # `from pkg import sub` imports the submodule pkg.sub where there is one.
                targets = [
                    f"{module}.{a.name}" if f"{module}.{a.name}" in files else module for a in node.names
                ]
            else:
                continue
            edges.update(t for t in targets if t in files and t != name)
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as ``[a, b, ..., a]``, or None (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in sorted(graph):
        if state.get(start):
            continue
        path, stack = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph[nxt])))
    return None


def test_no_import_cycle_in_the_package() -> None:
    graph = import_graph()
    assert len(graph) > 60 and "smart_batching.plan" in graph  # the scan saw the package
    assert "smart_batching.planners._spec" in graph["smart_batching.planners._common"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_no_import_inside_a_function_closes_a_cycle() -> None:
    graph = import_graph(deferred=True)
    assert "smart_batching.hf.kinds" in graph["smart_batching.hf"]  # the scan saw hf/
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle through an import inside a function: " + " -> ".join(cycle or [])


HF = f"{PACKAGE}.hf"
ENTRY = {HF, f"{HF}.kinds"}  # the package and the registry with the entry points


ADAPTERS = sorted(f"{HF}.{p.parent.name}" for p in (SRC / PACKAGE / "hf").glob("*/__init__.py"))
"""The sub-packages of ``hf/``: one adapter each."""


def _adapter(module: str) -> str | None:
    """The adapter sub-package of ``hf/`` that ``module`` belongs to, or None (the core or the entry)."""
    return next((a for a in ADAPTERS if module == a or module.startswith(a + ".")), None)


def test_hf_adapters_sit_between_the_core_and_the_entry_points() -> None:
    graph = import_graph(deferred=True)
    hf = {m: edges for m, edges in graph.items() if m == HF or m.startswith(HF + ".")}
    adapters = set(ADAPTERS)
    assert {f"{HF}.sft", f"{HF}.dpo", f"{HF}.grpo"} <= adapters
    for module, edges in hf.items():
        mine = _adapter(module)
        for target in edges:
            theirs = _adapter(target)
            if module in ENTRY:
                continue
            assert target not in ENTRY, f"{module} imports the entry point {target}"
            if mine is None:
                assert theirs is None, f"the shared core ({module}) imports the adapter {target}"
            else:
                assert theirs in (None, mine), f"the adapter {mine} imports another adapter ({target})"
    assert adapters <= graph[f"{HF}.kinds"], "the registry imports every adapter"


def test_the_plan_value_is_a_leaf() -> None:
    # The value every layer speaks imports nothing of the package but its errors.
    assert import_graph()["smart_batching.plan"] <= {"smart_batching.errors"}


def test_the_scan_finds_a_cycle_under_type_checking(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.b import B\n")
    (pkg / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import c\n"
        "def f():\n    from pkg import a  # deferred: not counted\n"
    )
    (pkg / "c.py").write_text("import pkg.a\n")
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.b"] == {"pkg.c"}
    assert find_cycle(graph) == ["pkg.a", "pkg.b", "pkg.c", "pkg.a"]
