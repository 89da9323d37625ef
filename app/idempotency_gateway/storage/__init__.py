"""Durable records: the store interface, its PostgreSQL and SQLite backends, SQL, schema.

``open_store(url, config)`` opens the backend a URL names. It is loaded on first use, like
every backend, so importing this package imports no database driver.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from idempotency_gateway.storage.backends import open_store as open_store

__all__ = ["open_store"]


def __getattr__(name: str) -> Any:
    if name == "open_store":
        from idempotency_gateway.storage.backends import open_store

        return open_store
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
