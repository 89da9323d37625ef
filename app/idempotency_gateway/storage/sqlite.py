"""``SqliteRecordStore``: every statement on the standard library's ``sqlite3``, in one thread.

The request path and the operators' paths run the plain SQL of ``sqlite_sql`` on one
connection that lives on a thread of its own: each operation is one hop to that thread and
back, and its statements run there back to back. SQLite has one writer per file anyway, so
one connection per process loses no parallelism that the database would give.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

from idempotency_gateway.clock import Clock
from idempotency_gateway.errors import StoreUnavailable
from idempotency_gateway.storage import sqlite_sql as sql
from idempotency_gateway.storage.base import (
    Claim,
    RecordStore,
    Reservation,
    StoredColumns,
    invalidation_from_row,
    record_from_row,
)
from idempotency_gateway.storage.errors import Driver, store_errors
from idempotency_gateway.storage.records import Fence, Invalidation, Record, RecordKey, Status

T = TypeVar("T")


def _schema_missing(exc: BaseException) -> bool:
    """SQLite has no SQLSTATE: its message says so ("no such table", "no such column")."""
    return isinstance(exc, sqlite3.OperationalError) and str(exc).startswith("no such ")


DRIVER = Driver(system="sqlite", errors=(sqlite3.Error,), schema_missing=_schema_missing)

_TIME_COLUMNS = ("lease_expires_at", "created_at", "updated_at", "expires_at")


def to_text(moment: datetime) -> str:
    """A time as the store keeps it: naive UTC, ``YYYY-MM-DD HH:MM:SS.ffffff``.

    SQLite has no time type, so times are text and every comparison of them is a text
    comparison: one fixed-width form makes text order time order. It is the form of
    SQLAlchemy's SQLite ``DateTime``, the type the migrations give these columns: files of
    earlier releases hold it (their admin paths wrote through SQLAlchemy), the migrations'
    table copies keep it, and SQLAlchemy reads it back. A row written then and one written
    now must compare correctly, so the form cannot change.
    """
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
    return {"scope": key.tenant, "operation": key.operation, "key": key.idempotency_key}


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

    def grant(db: sqlite3.Connection) -> sqlite3.Row | None:
        counter = _first(db.execute(sql.NEXT_TOKEN))
        if counter is None:
            raise sqlite3.DatabaseError("the fencing token counter has no row: migrate")
        return _first(db.execute(statement, values | {"token": counter[0]}))

    return _in_transaction(db, grant, keep=lambda row: row is not None)


def _in_transaction(
    db: sqlite3.Connection,
    work: Callable[[sqlite3.Connection], T],
    *,
    keep: Callable[[T], bool] = lambda _result: True,
) -> T:
    """Run ``work`` in one transaction, committed if ``keep`` says so of its result.

    IMMEDIATE: the writer's lock from the start, so work that reads and then writes never
    finds another process's write in its way half-way through."""
    db.execute("BEGIN IMMEDIATE")
    try:
        result = work(db)
    except BaseException:
        db.execute("ROLLBACK")
        raise
    db.execute("COMMIT" if keep(result) else "ROLLBACK")
    return result


class SqliteRecordStore(RecordStore):
    def __init__(self, path: str, *, clock: Clock | None = None) -> None:
        super().__init__(clock=clock)
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
        with store_errors(operation, DRIVER):
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

    async def ping(self) -> None:
        await self._run("ping", lambda db: db.execute("SELECT 1").fetchall())

    async def schema_revision(self) -> str | None:
        def read(db: sqlite3.Connection) -> str | None:
            if _first(db.execute(sql.SCHEMA_MIGRATED)) is None:
                return None
            revision = _first(db.execute(sql.SCHEMA_REVISION))
            return None if revision is None else str(revision[0])

        return await self._run("schema", read)

    def _now(self) -> str:
        return to_text(self.clock())

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
        return await self._changes("renew_lease", sql.RENEW_LEASE, values) > 0

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
        return await self._changes("finalize", sql.FINALIZE, values) > 0

    async def release_unsent(self, key: RecordKey, owner_id: str) -> bool:
        values = _key(key) | {"f_owner": owner_id, "now": to_text(self.clock())}
        return await self._changes("release_unsent", sql.RELEASE_UNSENT, values) > 0

    async def get(self, key: RecordKey) -> Record | None:
        row = await self._run("get", lambda db: _first(db.execute(sql.SELECT, _key(key))))
        return _record(row) if row is not None else None

    async def _delete_unless_live(self, key: RecordKey) -> bool:
        values = _key(key) | {"now": self._now()}
        return await self._changes("delete", sql.DELETE_UNLESS_LIVE, values) > 0

    async def _expire_unless_live(self, key: RecordKey) -> bool:
        values = _key(key) | {"now": self._now()}
        return await self._changes("expire", sql.EXPIRE_UNLESS_LIVE, values) > 0

    async def _changes(self, operation: str, statement: str, values: dict[str, Any]) -> int:
        """Rows ``statement`` wrote."""
        return await self._run(operation, lambda db: db.execute(statement, values).rowcount)

    async def _records(
        self, operation: str, statement: str, values: dict[str, Any]
    ) -> list[Record]:
        rows = await self._run(operation, lambda db: db.execute(statement, values).fetchall())
        return [_record(row) for row in rows]

    async def find_by_key(
        self, idempotency_key: str, *, operation: str | None = None, limit: int
    ) -> list[Record]:
        values = {"key": idempotency_key, "operation": operation, "limit": limit}
        return await self._records("find_by_key", sql.FIND_BY_KEY, values)

    async def list_stuck(self, *, limit: int) -> list[Record]:
        values = {"now": self._now(), "limit": limit}
        return await self._records("list_stuck", sql.LIST_STUCK, values)

    async def count_stuck(self, *, limit: int) -> int:
        values = {"now": self._now(), "limit": limit}
        return int(await self._run("count_stuck", lambda db: _only(db, sql.COUNT_STUCK, values)))

    async def _sweep_batch(self, batch_size: int) -> int | None:
        values = {"now": self._now(), "limit": batch_size}
        return await self._changes("sweep", sql.SWEEP_BATCH, values)

    async def set_breaker_override(self, upstream: str, state: str | None, at: datetime) -> None:
        if state is None:
            await self._changes(
                "breaker_override_set", sql.CLEAR_BREAKER_OVERRIDE, {"upstream": upstream}
            )
        else:
            values = {"upstream": upstream, "state": state, "at": to_text(at)}
            await self._changes("breaker_override_set", sql.SET_BREAKER_OVERRIDE, values)

    async def breaker_overrides(self) -> dict[str, str]:
        rows = await self._run(
            "breaker_override_sync", lambda db: db.execute(sql.BREAKER_OVERRIDES).fetchall()
        )
        return {row["upstream"]: row["state"] for row in rows}

    async def publish_invalidation(self, key: RecordKey) -> None:
        await self._changes("invalidation_publish", sql.PUBLISH_INVALIDATION, _key(key))

    async def newest_invalidations(self, *, within: timedelta) -> tuple[int, set[int]]:
        def read(db: sqlite3.Connection) -> tuple[int, set[int]]:
            newest = _only(db, sql.NEWEST_INVALIDATION, {})
            recent = db.execute(sql.RECENT_INVALIDATIONS, _seconds(within)).fetchall()
            return int(newest), {row["id"] for row in recent}

        return await self._run("invalidation_poll", lambda db: _in_transaction(db, read))

    async def invalidations_after(
        self, seen: int, *, within: timedelta, keep: timedelta
    ) -> list[Invalidation]:
        def read_and_prune(db: sqlite3.Connection) -> list[sqlite3.Row]:
            values = {"seen": seen} | _seconds(within)
            rows: list[sqlite3.Row] = db.execute(sql.INVALIDATIONS_AFTER, values).fetchall()
            db.execute(sql.PRUNE_INVALIDATIONS, _seconds(keep))
            return rows

        rows = await self._run("invalidation_poll", lambda db: _in_transaction(db, read_and_prune))
        return [invalidation_from_row(row) for row in rows]


def _only(db: sqlite3.Connection, statement: str, values: dict[str, Any]) -> Any:
    """The one value of a statement's one row."""
    row = _first(db.execute(statement, values))
    return None if row is None else row[0]


def _seconds(span: timedelta) -> dict[str, str]:
    return {"seconds": f"{span.total_seconds():f}"}
