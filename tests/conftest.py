"""Shared fixtures: real PostgreSQL and SQLite stores, migrated by Alembic.

``scripts/test`` makes sure PostgreSQL is running and the test database exists; the URL comes
from ``GATEWAY_TEST_DATABASE_URL``. Nothing here is skipped when PostgreSQL is missing: the
suite fails loudly instead, because a store test that did not run proves nothing.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from app.config import StoreConfig
from app.idempotency.store import RecordStore
from app.migrate import upgrade_to_head

DEFAULT_TEST_DATABASE_URL = "postgresql+asyncpg://postgres@127.0.0.1:5432/idempotency_gateway_test"


@pytest.fixture(scope="session")
def postgres_url() -> str:
    url = os.environ.get("GATEWAY_TEST_DATABASE_URL", DEFAULT_TEST_DATABASE_URL)
    upgrade_to_head(url)
    return url


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    url = f"sqlite+aiosqlite:///{tmp_path / 'records.db'}"
    upgrade_to_head(url)
    return url


@pytest.fixture(params=["postgresql", "sqlite"])
def database_url(request: pytest.FixtureRequest, postgres_url: str, tmp_path: Path) -> str:
    """Each test that takes this runs against both stores."""
    if request.param == "postgresql":
        return postgres_url
    url = f"sqlite+aiosqlite:///{tmp_path / 'records.db'}"
    upgrade_to_head(url)
    return url


class ManualClock:
    """A clock the test moves by hand: leases and TTLs expire without sleeping."""

    def __init__(self) -> None:
        self.now = datetime(2026, 1, 1, tzinfo=UTC)

    def __call__(self) -> datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
async def store(database_url: str, clock: ManualClock) -> AsyncIterator[RecordStore]:
    record_store = RecordStore.from_url(database_url, StoreConfig(), clock=clock)
    yield record_store
    await record_store.close()


@pytest.fixture
def unique() -> Callable[[str], str]:
    """Unique key names, so tests sharing the PostgreSQL database never collide."""
    import uuid

    run = uuid.uuid4().hex[:12]
    return lambda name: f"{name}-{run}"
