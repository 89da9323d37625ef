"""``SqliteRecordStore``: the hot path on the standard library's ``sqlite3``, in one thread.

Reserve, take over, renew lease, finalize and get run the plain SQL of ``sqlite_sql`` on one
connection that lives on a thread of its own: each operation is one hop to that thread and
back, its statements run there back to back, and no SQLAlchemy compile or result layer runs
per request. SQLite has one writer per file anyway, so one connection per process loses no
parallelism that the database would give. The admin and sweep paths stay on the SQLAlchemy
engine the base class keeps, on the same file.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

from sqlalchemy.ext.asyncio import AsyncEngine

from idempotency_gateway.clock import Clock
from idempotency_gateway.errors import StoreUnavailable
from idempotency_gateway.storage import sqlite_sql as sql
from idempotency_gateway.storage.base import (
    Claim,
    RecordStore,
    Reservation,
    StoredColumns,
    record_from_row,
    store_errors,
)
from idempotency_gateway.storage.records import Fence, Record, RecordKey, Status

T = TypeVar("T")

_TIME_COLUMNS = ("lease_expires_at", "created_at", "updated_at", "expires_at")


def to_text(moment: datetime) -> str:
    """A time as SQLAlchemy's SQLite ``DateTime`` writes it (naive UTC, microseconds), so text
    comparisons order times correctly and SQLAlchemy reads what this store wrote."""
    return moment.astimezone(UTC).replace(tzinfo=None).isoformat(" ", "microseconds")


def _record(row: sqlite3.Row) -> Record:
    data: dict[str, Any] = dict(zip(row.keys(), row, strict=True))
    for column in _TIME_COLUMNS:
        data[column] = datetime.fromisoformat(data[column]).replace(tzinfo=UTC)
    if data["response_headers"] is not None:
        data["response_headers"] = json.loads(data["response_headers"])
    data["body_compressed"] = bool(data["body_compressed"])
    data["body_omitted"] = bool(data["body_omitted"])
    return record_from_row(data)


def _key(key: RecordKey) -> dict[str, str]:
    return {"scope": key.scope, "operation": key.operation, "key": key.idempotency_key}


def _fence(fence: Fence) -> dict[str, Any]:
    return {"f_owner": fence.owner_id, "f_token": fence.fencing_token}


def _first(cursor: sqlite3.Cursor) -> sqlite3.Row | None:
    # fetchall, not fetchone: a statement with RETURNING commits only once it ran to the end.
    rows: list[sqlite3.Row] = cursor.fetchall()
    return rows[0] if rows else None


def _with_new_token(
    db: sqlite3.Connection, statement: str, values: dict[str, Any]
) -> sqlite3.Row | None:
    """Run an owner-granting ``statement`` with the counter's next fencing token, in one
    transaction; when it writes nothing, the counter stays as it was too."""
    db.execute("BEGIN IMMEDIATE")
    try:
        counter = _first(db.execute(sql.NEXT_TOKEN))
        if counter is None:
            raise sqlite3.DatabaseError("the fencing token counter has no row: migrate")
        row = _first(db.execute(statement, values | {"token": counter[0]}))
    except BaseException:
        db.execute("ROLLBACK")
        raise
    db.execute("COMMIT" if row is not None else "ROLLBACK")
    return row


class SqliteRecordStore(RecordStore):
    def __init__(self, engine: AsyncEngine, path: str, *, clock: Clock | None = None) -> None:
        super().__init__(engine, clock=clock)
        self._path = path
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sqlite-store")
        # Opened on first use, and only ever touched on ``_thread``.
        self._db: sqlite3.Connection | None = None
        self._closed = False

    def _opened(self) -> sqlite3.Connection:
        if self._db is None:
            # isolation_level None: autocommit, every statement is its own transaction.
            db = sqlite3.connect(self._path, isolation_level=None, check_same_thread=False)
            db.row_factory = sqlite3.Row
            for pragma in sql.PRAGMAS:
                db.execute(pragma)
            self._db = db
        return self._db

    async def _run(self, operation: str, work: Callable[[sqlite3.Connection], T]) -> T:
        with store_errors(operation, "sqlite"):
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._thread, lambda: work(self._opened()))

    async def start(self) -> None:
        await self._run("connect", lambda _db: None)

    def _disconnect(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            await asyncio.get_running_loop().run_in_executor(self._thread, self._disconnect)
            self._thread.shutdown()
        await super().close()

    async def reserve(self, key: RecordKey, claim: Claim) -> Reservation:
        now = self.clock()
        values = _key(key) | {
            "request_hash": claim.request_hash,
            "owner": claim.owner_id,
            "now": to_text(now),
            "lease_expires_at": to_text(now + timedelta(seconds=claim.lease)),
            "expires_at": to_text(now + timedelta(seconds=claim.ttl)),
        }

        def insert_or_read(db: sqlite3.Connection) -> tuple[sqlite3.Row | None, bool]:
            inserted = _with_new_token(db, sql.RESERVE, values)
            if inserted is not None:
                return inserted, True
            # The insert lost: a plain read sees the row that holds the key.
            return _first(db.execute(sql.SELECT, _key(key))), False

        row, reserved = await self._run("reserve", insert_or_read)
        if row is None:
            # Deleted between our insert and read: rare enough that the caller just retries.
            raise StoreUnavailable("the record vanished while being reserved; retry")
        return Reservation(_record(row), reserved, now)

    async def take_over(self, seen: Record, claim: Claim) -> Record | None:
        now = self.clock()
        values = _key(seen.key) | {
            "s_status": seen.status.value,
            "s_owner": seen.owner_id,
            "s_token": seen.fencing_token,
            "request_hash": claim.request_hash,
            "owner": claim.owner_id,
            "now": to_text(now),
            "lease_expires_at": to_text(now + timedelta(seconds=claim.lease)),
            "expires_at": to_text(now + timedelta(seconds=claim.ttl)),
        }
        row = await self._run("take_over", lambda db: _with_new_token(db, sql.TAKE_OVER, values))
        return _record(row) if row is not None else None

    async def renew_lease(self, key: RecordKey, fence: Fence, *, lease: float) -> bool:
        now = self.clock()
        values = _key(key) | _fence(fence)
        values |= {"now": to_text(now), "lease_expires_at": to_text(now + timedelta(seconds=lease))}
        changed = await self._run(
            "renew_lease", lambda db: db.execute(sql.RENEW_LEASE, values).rowcount
        )
        return changed > 0

    async def _write_outcome(
        self, key: RecordKey, fence: Fence, status: Status, answer: StoredColumns, ttl: float
    ) -> bool:
        now = self.clock()
        values = _key(key) | _fence(fence)
        values |= {
            "status": status.value,
            "now": to_text(now),
            "keep": to_text(now + timedelta(seconds=ttl)),
            "response_status": answer.status,
            "response_headers": None if answer.headers is None else json.dumps(answer.headers),
            "response_body": answer.body,
            "body_compressed": answer.compressed,
            "body_omitted": answer.omitted,
        }
        changed = await self._run("finalize", lambda db: db.execute(sql.FINALIZE, values).rowcount)
        return changed > 0

    async def release_unsent(self, key: RecordKey, owner_id: str) -> bool:
        values = _key(key) | {"f_owner": owner_id, "now": to_text(self.clock())}
        changed = await self._run(
            "release_unsent", lambda db: db.execute(sql.RELEASE_UNSENT, values).rowcount
        )
        return changed > 0

    async def get(self, key: RecordKey) -> Record | None:
        row = await self._run("get", lambda db: _first(db.execute(sql.SELECT, _key(key))))
        return _record(row) if row is not None else None
