"""The SQLite store keeps times in the text form SQLAlchemy's ``DateTime`` writes, so a file
written by an earlier release (whose admin paths wrote through SQLAlchemy) reads back the same
instants, and its rows compare correctly with the ones the store writes now."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from sqlalchemy import insert

from idempotency_gateway.config import StoreConfig
from idempotency_gateway.storage import open_store
from idempotency_gateway.storage.base import Claim
from idempotency_gateway.storage.records import RecordKey, Status
from idempotency_gateway.storage.schema import records
from tests.support.clock import ManualClock
from tests.support.database import on_database

OPERATION = "POST /v1/charges"


async def test_rows_written_through_sqlalchemy_read_and_compare_as_the_stores_own(
    sqlite_url: str, clock: ManualClock
) -> None:
    written = clock.now = datetime(2030, 1, 2, 3, 4, 5, 123456, tzinfo=UTC)
    earlier = RecordKey("scope", OPERATION, "written-by-sqlalchemy")
    row = {
        "scope": earlier.tenant,
        "operation": earlier.operation,
        "idempotency_key": earlier.idempotency_key,
        "request_hash": "h",
        "status": Status.IN_PROGRESS.value,
        "owner_id": "0" * 32,
        "fencing_token": 1,
        "lease_expires_at": written + timedelta(seconds=30),
        "attempts": 1,
        "created_at": written,
        "updated_at": written,
        "expires_at": written + timedelta(seconds=60),
    }
    await on_database(sqlite_url, lambda connection: connection.execute(insert(records), row))
    store = open_store(sqlite_url, StoreConfig(), clock=clock.utc)
    try:
        stored = await store.get(earlier)
        assert stored is not None
        assert stored.lease_expires_at == written + timedelta(seconds=30)
        assert stored.created_at == written
        assert stored.created_at.tzinfo is UTC

        # The store's own row, written a second later, orders after it.
        clock.advance(1.0)
        later = RecordKey("scope", OPERATION, "written-by-the-store")
        assert (await store.reserve(later, Claim("h", "1" * 32, lease=30.0, ttl=60.0))).reserved

        clock.advance(29.5)  # the SQLAlchemy row's lease ran out, the store's not yet
        assert [record.key for record in await store.list_stuck(limit=10)] == [earlier]
        clock.advance(1.0)
        assert [record.key for record in await store.list_stuck(limit=10)] == [earlier, later]
    finally:
        await store.close()


async def test_the_store_writes_the_text_sqlalchemy_reads(sqlite_url: str) -> None:
    instant = datetime(2030, 1, 2, 3, 4, 5, 678901, tzinfo=UTC)
    store = open_store(sqlite_url, StoreConfig(), clock=lambda: instant)
    key = RecordKey("scope", OPERATION, "read-by-sqlalchemy")
    try:
        assert (await store.reserve(key, Claim("h", "2" * 32, lease=30.0, ttl=60.0))).reserved
    finally:
        await store.close()
    created = await on_database(
        sqlite_url,
        lambda connection: (
            connection.execute(
                records.select().where(records.c.idempotency_key == key.idempotency_key)
            )
            .one()
            .created_at
        ),
    )
    assert created.replace(tzinfo=UTC) == instant
