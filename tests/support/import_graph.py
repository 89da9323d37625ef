"""The package's modules and every import between them, to find import circles.

Every import counts: top-level, inside a function and under ``if TYPE_CHECKING:``. A lazy or
type-only import hides a circle from the interpreter, not from a reader, who still cannot
understand either module without the other.

``python -m tests.support.import_graph`` prints, per wing (folder or top-level module), its
files, lines and the circles that pass through it.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from collections.abc import Iterator, Mapping
from pathlib import Path

import idempotency_gateway

PACKAGE = Path(idempotency_gateway.__file__).parent
NAME = "idempotency_gateway"


def module_name(path: Path) -> str:
    relative = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = relative.parts[:-1] if relative.name == "__init__" else relative.parts
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _absolute(importer: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    # A relative import counts from the importer's package (itself, for an __init__).
    parts = importer.split(".")
    base = parts if is_package else parts[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def imported_modules(name: str, path: Path, known: Mapping[str, Path]) -> set[str]:
    """The package's modules that ``name`` imports, wherever in the file the import stands.

    ``from a.b import c`` counts as importing ``a.b.c`` when that is a module, else ``a.b``.
    """
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(name, path.name == "__init__.py", node)
            for alias in node.names:
                candidate = f"{source}.{alias.name}"
                found.add(candidate if candidate in known else source)
    return {module for module in found if module in known and module != name}


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imported_modules(name, path, known) for name, path in known.items()}


def circles(edges: Mapping[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(edges.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component: list[str] = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return sorted(found)


def wing_of(module: str) -> str:
    """``idempotency_gateway.replay.cache`` -> ``replay``; a top-level module is its own wing."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _report() -> Iterator[str]:
    known = modules()
    found = circles(graph())
    files: dict[str, int] = defaultdict(int)
    lines: dict[str, int] = defaultdict(int)
    for name, path in known.items():
        files[wing_of(name)] += 1
        lines[wing_of(name)] += len(path.read_text().splitlines())
    through: dict[str, int] = defaultdict(int)
    for circle in found:
        for wing in {wing_of(module) for module in circle}:
            through[wing] += 1
    yield f"{'wing':<14}{'files':>6}{'lines':>7}{'circles':>9}"
    for wing in sorted(files, key=lambda wing: (-files[wing], wing)):
        yield f"{wing:<14}{files[wing]:>6}{lines[wing]:>7}{through[wing]:>9}"
    for circle in found:
        yield "circle: " + " <-> ".join(module.removeprefix(NAME + ".") for module in circle)


if __name__ == "__main__":
    print("\n".join(_report()))
