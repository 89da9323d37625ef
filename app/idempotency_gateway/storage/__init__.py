"""Durable records: the store interface, its PostgreSQL and SQLite backends, SQL, schema.

``open_store(url, config)`` opens the backend a URL names. Each backend's module is loaded
when a URL first asks for it, so importing this package imports no database driver.
``backends`` is imported here, ahead of any other module of the package, because it also
sets the deprecated ``RecordStore.from_url``.
"""

from idempotency_gateway.storage.backends import open_store

__all__ = ["open_store"]
