"""Imports only point down: the package's folders are its layers (docs/ARCHITECTURE.md).

A module may import from its own folder and from any layer below its own; never from a layer
above, and never from a sibling package of the same layer (``idempotency`` and ``proxy`` share
only what lies below them, such as ``execution``).

The rule is stated twice: as import-linter contracts (``[tool.importlinter]`` in
pyproject.toml, which also follow indirect imports), run here as ``lint-imports``, and as
``LAYERS`` below, which a layers contract cannot say all of: that the package's own
``__init__`` (the public API) is imported by the CLI alone.

Nor do modules import each other in a circle, even through an import inside a function or
under ``TYPE_CHECKING`` (``tests.support.import_graph``, which also prints the wings).
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.import_graph import NAME, PACKAGE, circles, graph, module_name, wing_of
from tests.support.servers import PROJECT_ROOT

# Lowest first. A name is a top-level module or a folder of the package.
LAYERS: tuple[frozenset[str], ...] = (
    frozenset({"database_url", "extras", "lazy"}),
    frozenset({"errors", "config", "clock"}),
    frozenset({"asgi"}),
    frozenset({"problems", "request_id", "execution"}),
    frozenset({"target"}),
    frozenset({"routing"}),
    frozenset({"telemetry", "server", "drain"}),
    frozenset({"resilience", "webhooks"}),
    frozenset({"storage"}),
    frozenset({"replay"}),
    frozenset({"idempotency", "proxy"}),
    frozenset({"migrate"}),
    frozenset({"operations"}),
    frozenset({"main", "client"}),
    frozenset({"serve"}),
    frozenset({"demo"}),
    # The public API re-exports from every layer below; only the CLI reads it (the version).
    frozenset({"__init__"}),
    frozenset({"cli"}),
)


def _layer_of(unit: str) -> int:
    for index, layer in enumerate(LAYERS):
        if unit in layer:
            return index
    raise AssertionError(f"{unit} belongs to no layer: add it to LAYERS in {__file__}")


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append(node.module)
    return [name for name in found if name == NAME or name.startswith(NAME + ".")]


MODULES = sorted(PACKAGE.rglob("*.py"))

# Modules kept from a layer they could otherwise reach: the engine and the records of what it
# did never note telemetry; the middleware turns their report into the request log, once.
KEPT_APART: dict[str, frozenset[str]] = {
    "idempotency/engine.py": frozenset({"telemetry"}),
    "idempotency/report.py": frozenset({"telemetry"}),
}


def test_every_folder_and_module_has_a_layer() -> None:
    units = {wing_of(module_name(path)) for path in MODULES}
    for unit in units:
        _layer_of(unit)


@pytest.mark.parametrize("path", MODULES, ids=lambda path: str(path.relative_to(PACKAGE)))
def test_imports_point_down(path: Path) -> None:
    importer = wing_of(module_name(path))
    upward = [
        imported
        for imported in _imports(path)
        if (unit := wing_of(imported)) != importer and _layer_of(unit) >= _layer_of(importer)
    ]
    assert not upward, f"{path.relative_to(PACKAGE)} imports from its own layer or above: {upward}"


def test_the_import_linter_contracts_are_kept() -> None:
    lint_imports = "from importlinter.cli import lint_imports_command; lint_imports_command()"
    result = subprocess.run(
        [sys.executable, "-c", lint_imports, "--no-cache"],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(r"Contracts: [1-9]\d* kept, 0 broken", result.stdout), result.stdout


@pytest.mark.parametrize("module", sorted(KEPT_APART))
def test_kept_apart(module: str) -> None:
    forbidden = KEPT_APART[module]
    imported = [name for name in _imports(PACKAGE / module) if wing_of(name) in forbidden]
    assert not imported, f"{module} imports {imported}"


def test_no_module_imports_itself_through_others() -> None:
    assert circles(graph()) == []
