"""Alembic environment: runs migrations on asyncpg for PostgreSQL, on the standard library's
sqlite3 for SQLite (the drivers the stores run on, so migrating needs no other)."""

from __future__ import annotations

import asyncio
import os

from alembic import context
from sqlalchemy import create_engine
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import create_async_engine

from idempotency_gateway.database_url import backend_of, normalize_database_url
from idempotency_gateway.storage.schema import metadata

# An arbitrary constant naming the gateway's migration lock among the database's advisory locks.
_MIGRATION_LOCK = 7_041_873_512


def _database_url() -> str:
    url = context.config.get_main_option("sqlalchemy.url") or os.environ.get("GATEWAY_DATABASE_URL")
    if not url:
        raise RuntimeError("no database URL: set GATEWAY_DATABASE_URL")
    return normalize_database_url(url)


def _run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=metadata,
        # SQLite cannot ALTER most things in place; batch mode copies the table instead.
        render_as_batch=connection.dialect.name == "sqlite",
    )
    with context.begin_transaction():
        if connection.dialect.name == "postgresql":
            # Processes migrating at once (workers of one server, replicas of one release)
            # take turns: each reads the revision only after the one before it committed.
            connection.exec_driver_sql(f"SELECT pg_advisory_xact_lock({_MIGRATION_LOCK})")
        context.run_migrations()


async def _run_online() -> None:
    engine = create_async_engine(_database_url())
    async with engine.connect() as connection:
        await connection.run_sync(_run)
        await connection.commit()
    await engine.dispose()


def _run_online_sqlite() -> None:
    engine = create_engine(_database_url())
    with engine.connect() as connection:
        _run(connection)
        connection.commit()
    engine.dispose()


if context.is_offline_mode():
    context.configure(url=_database_url(), target_metadata=metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()
elif backend_of(_database_url()) == "sqlite":
    _run_online_sqlite()
else:
    asyncio.run(_run_online())
