"""A package's exports, imported on first use (PEP 562).

A package ``__init__`` that imported its exports eagerly would load them for anyone who
imports one small module of it: ``idempotency_gateway.idempotency.keys`` would cost the
middleware, and with it SQLAlchemy, asyncpg, redis and prometheus_client. The package lists
its exports' homes instead, and imports them under ``TYPE_CHECKING`` so type checkers see them.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(
    package: str, homes: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of ``package``, which exports each name of
    ``homes`` from the module it maps to."""
    namespace = vars(sys.modules[package])

    def __getattr__(name: str) -> Any:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(home), name)
        namespace[name] = value  # once imported, found without this function
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(homes))

    return __getattr__, __dir__
