"""Layout rules, checked on the source with ``ast`` (nothing is imported).

* The client package stands alone: no module under ``client/kvtier`` imports
  the daemon's package ``kvtierd`` when it is imported (a serving container
  installs the client only).  A function may import it lazily (``kvtier
  doctor`` loads a daemon config), and so may an ``if TYPE_CHECKING:`` block.
* Imports inside ``kvtier`` run one way: ``kvtier.cli`` dispatches to the
  tools (bench, doctor, top, demo), nothing imports ``kvtier.cli``, and the
  package's import graph -- lazy imports in functions included -- has no cycle.
"""

from __future__ import annotations

import ast
import pathlib
from collections.abc import Iterator

ROOT = pathlib.Path(__file__).resolve().parent.parent
CLIENT = ROOT / "client"
PACKAGE = CLIENT / "kvtier"


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(CLIENT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, pathlib.Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))
            if "v1" not in p.relative_to(PACKAGE).parts}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_time_nodes(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """Statements that run when the module is imported (not function bodies, not
    ``if TYPE_CHECKING:`` blocks)."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if isinstance(node, ast.If) and _is_type_checking(node):
            yield from _import_time_nodes(node.orelse)
            continue
        yield node
        for field in ("body", "orelse", "finalbody", "handlers"):
            inner = getattr(node, field, None)
            if isinstance(inner, list):
                yield from _import_time_nodes([n for n in inner if isinstance(n, ast.stmt)]
                                              + [s for h in inner
                                                 if isinstance(h, ast.ExceptHandler)
                                                 for s in h.body])


def _imported(node: ast.AST, module: str, is_package: bool,
              known: dict[str, pathlib.Path] | None = None) -> list[str]:
    """Absolute names of the modules a node imports.

    ``from a import b`` imports ``a.b`` when that is a module of ``known``, else
    ``a`` itself (``from kvtier import errors`` vs ``from kvtier import __version__``);
    without ``known``, both names are returned.
    """
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        prefix = ".".join(base + ([node.module] if node.module else []))
    else:
        prefix = node.module or ""
    if known is None:
        return [prefix] + [f"{prefix}.{a.name}" for a in node.names]
    return [f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in known else prefix
            for a in node.names]


def test_client_package_does_not_import_the_daemon_package_at_import_time() -> None:
    offenders = []
    for name, path in _modules().items():
        tree = ast.parse(path.read_text(), str(path))
        for node in _import_time_nodes(tree.body):
            for target in _imported(node, name, path.name == "__init__.py"):
                if target == "kvtierd" or target.startswith("kvtierd."):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: {target}")
    assert not offenders, "client modules importing kvtierd at import time:\n" + "\n".join(
        sorted(set(offenders)))


def _graph() -> dict[str, set[str]]:
    """kvtier module -> the kvtier modules it imports anywhere (lazy imports too)."""
    mods = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        graph[name] = {t for node in ast.walk(tree)
                       for t in _imported(node, name, path.name == "__init__.py", mods)
                       if t in mods and t != name}
    return graph


def test_nothing_imports_the_cli() -> None:
    importers = sorted(m for m, deps in _graph().items() if "kvtier.cli" in deps)
    assert importers == [], f"kvtier.cli is the front door only; imported by {importers}"


def test_tools_import_graph_has_no_cycle() -> None:
    graph = _graph()
    tools = {m for m in graph if m in ("kvtier.cli", "kvtier.bench", "kvtier.doctor",
                                       "kvtier.top") or m.startswith("kvtier.demo")}
    assert {"kvtier.cli", "kvtier.bench", "kvtier.doctor", "kvtier.top",
            "kvtier.demo.run"} <= tools
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for dep in sorted(graph.get(m, ())):
            if state.get(dep) == 1:
                cycle = path[path.index(dep):] + [dep]
                if any(c in tools for c in cycle):
                    raise AssertionError("import cycle through the tools: "
                                         + " -> ".join(cycle))
            elif dep not in state:
                visit(dep)
        path.pop()
        state[m] = 2

    for m in sorted(tools):
        if m not in state:
            visit(m)
