"""``open_store``: the record store a database URL names, on that database's own driver.

The backend's module is imported here, when a URL asks for it, and nowhere else: a gateway
on SQLite never imports asyncpg, and the base class never imports a backend. The deprecated
``RecordStore.from_url`` forwards here; it is set on the class below, not written in
``base``, so that the interface never imports the module that imports its backends.
"""

from __future__ import annotations

import warnings

from idempotency_gateway.clock import Clock
from idempotency_gateway.config import StoreConfig
from idempotency_gateway.database_url import backend_of, sqlite_path
from idempotency_gateway.extras import require_database_driver
from idempotency_gateway.storage.base import RecordStore


def open_store(url: str, config: StoreConfig, *, clock: Clock | None = None) -> RecordStore:
    """The store at ``url`` (``postgresql://...``, a libpq host list included, or
    ``sqlite:///path``), on a database migrated to the head. Nothing connects yet: the
    first connection is made by ``await store.start()`` or the first statement.

    ``clock`` pins the store's "now" (tests that move time by hand); ``ValueError`` for a
    URL of any other database, without echoing it (it may hold a password).
    """
    backend = backend_of(url)
    if backend == "postgresql":
        require_database_driver(url)
        from idempotency_gateway.storage.postgres import PostgresRecordStore

        return PostgresRecordStore(url, config, clock=clock)
    if backend == "sqlite":
        from idempotency_gateway.storage.sqlite import SqliteRecordStore

        return SqliteRecordStore(sqlite_path(url), clock=clock)
    raise ValueError("not a database URL the store can open (postgresql://... or sqlite://...)")


def _from_url(url: str, config: StoreConfig, *, clock: Clock | None = None) -> RecordStore:
    """Deprecated: ``open_store(url, config)`` from ``idempotency_gateway.storage``."""
    warnings.warn(
        "RecordStore.from_url is deprecated; use idempotency_gateway.storage.open_store",
        DeprecationWarning,
        stacklevel=2,
    )
    return open_store(url, config, clock=clock)


RecordStore.from_url = staticmethod(_from_url)
