"""The optional parts of the install, and the one-line error that names a missing one.

    pip install idempotency-gateway             the middleware on SQLite, in-process cache
    pip install 'idempotency-gateway[postgres]' + the PostgreSQL store (asyncpg)
    pip install 'idempotency-gateway[redis]'    + the Redis replay cache and wake-ups
    pip install 'idempotency-gateway[server]'   + the standalone gateway (serve, demo)
    pip install 'idempotency-gateway[all]'      all of the above

A driver is looked for (never imported) where a URL is turned into a store or a cache, so a
``postgresql://`` URL without ``[postgres]`` fails there, naming the extra, rather than deep
inside SQLAlchemy's dialect loading.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable

# What ``serve`` and ``demo`` import: uvicorn with uvloop, httptools for the upstream client
# and the edge protocol, FastAPI (and its offline docs) for the admin API.
SERVER_MODULES = ("uvicorn", "uvloop", "httptools", "fastapi", "fastapi_offline")


class MissingExtra(ImportError):
    """A feature's optional dependencies are not installed; the message says what to install."""

    def __init__(self, feature: str, extra: str) -> None:
        super().__init__(
            f"{feature} needs the [{extra}] extra: pip install 'idempotency-gateway[{extra}]'"
        )
        self.extra = extra


def require(modules: Iterable[str], *, extra: str, feature: str) -> None:
    """Raise ``MissingExtra`` unless every module can be imported."""
    if any(importlib.util.find_spec(module) is None for module in modules):
        raise MissingExtra(feature, extra)


def require_database_driver(database_url: str) -> None:
    """The driver a database URL needs; the embedded SQLite store needs none beyond the base."""
    if database_url.startswith(("postgresql", "postgres:")):
        require(["asyncpg"], extra="postgres", feature="a PostgreSQL database")


def require_redis() -> None:
    require(["redis"], extra="redis", feature="a Redis URL")


def require_server() -> None:
    require(SERVER_MODULES, extra="server", feature="the standalone gateway")
