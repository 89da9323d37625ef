"""The tables as they are, looked at through SQLAlchemy apart from any store: how a test
checks what a store wrote, or changes a row behind a store's back."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

from sqlalchemy import create_engine
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import create_async_engine

from idempotency_gateway.database_url import backend_of, normalize_database_url

T = TypeVar("T")


async def on_database(url: str, work: Callable[[Connection], T]) -> T:
    """Run ``work`` in one committed transaction on a connection of its own to ``url``: on
    asyncpg for PostgreSQL, on a thread with ``sqlite3`` for SQLite."""
    normalized = normalize_database_url(url)
    if backend_of(url) == "sqlite":

        def run() -> T:
            engine = create_engine(normalized)
            try:
                with engine.begin() as connection:
                    return work(connection)
            finally:
                engine.dispose()

        return await asyncio.to_thread(run)
    engine = create_async_engine(normalized)
    try:
        async with engine.begin() as connection:
            return await connection.run_sync(work)
    finally:
        await engine.dispose()
