"""The package's import graph has no cycle: every `import` of a `lit_packing` module counts, at module level, inside
a function or class, or under `TYPE_CHECKING`, and so do a package `__init__`'s re-exports.

A cycle is a strongly connected component of more than one module; the test names each one it finds. Where a
submodule would import its own package's `__init__` (which imports the submodule back), it imports the name from
the module that defines it.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "lit_packing"


def module_name(path: Path) -> str:
    """`lit_packing/data/feed.py` -> `lit_packing.data.feed`; a package's `__init__.py` is the package."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module a `from ... import` names, its relative dots resolved against `module`'s package."""
    if not node.level:
        return node.module or ""
    package = module.split(".") if is_package else module.split(".")[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def imports_in(text: str, module: str, is_package: bool = False) -> set[str]:
    """The `lit_packing` modules the source `text` of `module` imports anywhere (module level, a function or class
    body, `if TYPE_CHECKING:`); `from pkg import name` is an edge to `pkg.name` where that is a module, else to
    `pkg`."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(module, is_package, node)
            for alias in node.names:
                found.add(f"{source}.{alias.name}" if f"{source}.{alias.name}" in MODULES else source)
    found = {name for name in found if name == "lit_packing" or name.startswith("lit_packing.")}
    found.discard(module)
    return found


def imports(module: str) -> set[str]:
    """The package's modules `module` imports (`imports_in` of its file)."""
    path = MODULES[module]
    return imports_in(path.read_text(), module, is_package=path.name == "__init__.py")


def import_graph() -> dict[str, set[str]]:
    """Every module of the package -> the package's modules it imports (a name that is no module is dropped)."""
    unknown = {(m, t) for m in MODULES for t in imports(m) if t not in MODULES}
    assert not unknown, f"imports of modules that do not exist: {sorted(unknown)}"
    return {module: imports(module) for module in MODULES}


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of `graph`, each sorted, in sorted order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(components)


def test_strongly_connected_finds_a_cycle_and_leaves_a_chain_apart():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert strongly_connected(graph) == [["a", "b", "c"], ["d"], ["e"]]


def test_every_kind_of_import_is_an_edge():
    text = """
from typing import TYPE_CHECKING
import lit_packing.batch
from lit_packing.samplers import PlannedBatchSampler
from lit_packing.data import collate
from ..errors import ConfigError
from . import tokenize
if TYPE_CHECKING:
    from lit_packing.data.datamodule import PackingDataModule
def late():
    from lit_packing.data.stream import Stream
class Holder:
    from .shapes import CHAT
"""
    assert imports_in(text, "lit_packing.data.feed") == {
        "lit_packing.batch",
        "lit_packing.samplers",  # a name that is no module: an edge to the package's `__init__`
        "lit_packing.data.collate",  # a module imported from its package: an edge to the module
        "lit_packing.errors",
        "lit_packing.data.tokenize",
        "lit_packing.data.datamodule",
        "lit_packing.data.stream",
        "lit_packing.data.shapes",
    }
    assert imports_in("from .base import AUTO", "lit_packing.samplers", is_package=True) == {
        "lit_packing.samplers.base"
    }
    assert "lit_packing.samplers.base" in imports("lit_packing.samplers")  # a package's re-exports are edges


def test_the_package_has_no_import_cycle():
    cycles = [component for component in strongly_connected(import_graph()) if len(component) > 1]
    assert not cycles, "import cycles (each a set of modules that import one another): " + "; ".join(
        " <-> ".join(component) for component in cycles
    )
