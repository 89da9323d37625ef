"""``RecordStore``: every transition of a record is one atomic SQL statement.

One code path through SQLAlchemy Core serves PostgreSQL (asyncpg) and SQLite (aiosqlite). The
store decides nothing: it runs compare-and-set statements and reports whether they matched;
``app.idempotency.machine`` decides what a record means.

Round trips on the hot path: a new key costs one reserve and one finalize; a duplicate costs
one statement (on PostgreSQL the reserve returns the existing row in the same round trip).
Statements run in autocommit mode, so none pays for a separate BEGIN and COMMIT.
"""

from __future__ import annotations

import zlib
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import (
    ColumnElement,
    Row,
    and_,
    delete,
    event,
    exists,
    literal,
    select,
    tuple_,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from app.config import StoreConfig
from app.errors import StoreUnavailable
from app.idempotency.record import Fence, Record, RecordKey, Status, StoredResponse
from app.idempotency.schema import records

Clock = Callable[[], datetime]

# Bodies below this size are stored as they are: compressing them saves nothing worth a CPU.
_COMPRESS_FROM = 1024


def utc_now() -> datetime:
    return datetime.now(UTC)


@dataclass(frozen=True, slots=True)
class Claim:
    """What an execution asks for when it reserves or takes over a record."""

    request_hash: str
    owner_id: str
    lease: float
    ttl: float


@dataclass(frozen=True, slots=True)
class Reservation:
    """The outcome of a reserve: our fresh row, or the row that was already there."""

    record: Record
    reserved: bool


def _aware(moment: datetime) -> datetime:
    # SQLite hands back naive datetimes; every time the store writes is UTC.
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


def _encode_body(body: bytes) -> tuple[bytes, bool]:
    if len(body) < _COMPRESS_FROM:
        return body, False
    compressed = zlib.compress(body, 1)
    if len(compressed) >= len(body):
        return body, False
    return compressed, True


def _record_from_row(row: Row[Any]) -> Record:
    data = row._mapping
    response = None
    if data["response_status"] is not None:
        stored_body = data["response_body"] or b""
        response = StoredResponse(
            status=data["response_status"],
            headers=[(name, value) for name, value in data["response_headers"] or []],
            body=zlib.decompress(stored_body) if data["body_compressed"] else stored_body,
            body_omitted=data["body_omitted"],
        )
    return Record(
        key=RecordKey(data["scope"], data["operation"], data["idempotency_key"]),
        request_hash=data["request_hash"],
        status=Status(data["status"]),
        owner_id=data["owner_id"],
        fencing_token=data["fencing_token"],
        lease_expires_at=_aware(data["lease_expires_at"]),
        response=response,
        attempts=data["attempts"],
        created_at=_aware(data["created_at"]),
        updated_at=_aware(data["updated_at"]),
        expires_at=_aware(data["expires_at"]),
    )


def _is_key(key: RecordKey) -> ColumnElement[bool]:
    return and_(
        records.c.scope == key.scope,
        records.c.operation == key.operation,
        records.c.idempotency_key == key.idempotency_key,
    )


def _is_fenced_by(fence: Fence) -> ColumnElement[bool]:
    return and_(
        records.c.status == Status.IN_PROGRESS.value,
        records.c.owner_id == fence.owner_id,
        records.c.fencing_token == fence.fencing_token,
    )


def normalize_database_url(url: str) -> str:
    """Accept the URLs operators write (``postgresql://``) and pick the async drivers."""
    for plain, async_driver in (
        ("postgresql://", "postgresql+asyncpg://"),
        ("postgres://", "postgresql+asyncpg://"),
        ("sqlite://", "sqlite+aiosqlite://"),
    ):
        if url.startswith(plain):
            return async_driver + url[len(plain) :]
    return url


def create_engine_for(url: str, config: StoreConfig) -> AsyncEngine:
    url = normalize_database_url(url)
    if url.startswith("sqlite"):
        engine = create_async_engine(
            url,
            isolation_level="AUTOCOMMIT",
            connect_args={"timeout": config.statement_timeout},
        )
        _tune_sqlite(engine)
        return engine
    return create_async_engine(
        url,
        isolation_level="AUTOCOMMIT",
        pool_size=config.pool_size,
        max_overflow=0,
        pool_timeout=config.connect_timeout,
        connect_args={
            "timeout": config.connect_timeout,
            "command_timeout": config.statement_timeout,
        },
    )


def _tune_sqlite(engine: AsyncEngine) -> None:
    @event.listens_for(engine.sync_engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # WAL lets readers run beside the single writer; busy_timeout makes the writers of
        # several worker processes queue instead of failing with "database is locked".
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute("PRAGMA busy_timeout=5000")
        cursor.close()


class RecordStore:
    def __init__(self, engine: AsyncEngine, *, clock: Clock = utc_now) -> None:
        self.engine = engine
        self.clock = clock
        self._is_postgres = engine.dialect.name == "postgresql"

    @classmethod
    def from_url(cls, url: str, config: StoreConfig, *, clock: Clock = utc_now) -> RecordStore:
        return cls(create_engine_for(url, config), clock=clock)

    async def close(self) -> None:
        await self.engine.dispose()

    @asynccontextmanager
    async def _connection(self) -> AsyncIterator[AsyncConnection]:
        """The one place where driver and pool errors become ``StoreUnavailable``."""
        try:
            async with self.engine.connect() as connection:
                yield connection
        except (SQLAlchemyError, OSError, TimeoutError) as exc:
            raise StoreUnavailable(f"idempotency store error: {type(exc).__name__}") from exc

    async def ping(self) -> None:
        async with self._connection() as connection:
            await connection.execute(select(literal(1)))

    async def reserve(self, key: RecordKey, claim: Claim) -> Reservation:
        """Insert a fresh ``IN_PROGRESS`` row, or return the row that holds the key."""
        now = self.clock()
        values = {
            "scope": key.scope,
            "operation": key.operation,
            "idempotency_key": key.idempotency_key,
            "request_hash": claim.request_hash,
            "status": Status.IN_PROGRESS.value,
            "owner_id": claim.owner_id,
            "fencing_token": 1,
            "lease_expires_at": now + timedelta(seconds=claim.lease),
            "attempts": 1,
            "body_compressed": False,
            "body_omitted": False,
            "created_at": now,
            "updated_at": now,
            "expires_at": now + timedelta(seconds=claim.ttl),
        }
        async with self._connection() as connection:
            if self._is_postgres:
                row = await self._insert_or_read_postgres(connection, key, values)
                if row is not None:
                    return Reservation(_record_from_row(row), reserved=row.reserved)
            else:
                inserted = await connection.execute(
                    sqlite.insert(records)
                    .values(values)
                    .on_conflict_do_nothing()
                    .returning(*records.c)
                )
                row = inserted.first()
                if row is not None:
                    return Reservation(_record_from_row(row), reserved=True)
            # The holder committed after this statement's snapshot began (PostgreSQL) or the
            # insert lost (SQLite): a plain read now sees it.
            existing = (await connection.execute(select(records).where(_is_key(key)))).first()
        if existing is None:
            # Deleted between our insert and read: rare enough that the caller just retries.
            raise StoreUnavailable("the record vanished while being reserved; retry")
        return Reservation(_record_from_row(existing), reserved=False)

    async def _insert_or_read_postgres(
        self, connection: AsyncConnection, key: RecordKey, values: dict[str, Any]
    ) -> Row[Any] | None:
        inserted = (
            postgresql.insert(records)
            .values(values)
            .on_conflict_do_nothing(index_elements=["scope", "operation", "idempotency_key"])
            .returning(*records.c)
            .cte("inserted")
        )
        statement = select(literal(True).label("reserved"), *inserted.c).union_all(
            select(literal(False).label("reserved"), *records.c).where(
                _is_key(key), ~exists(select(inserted.c.scope))
            )
        )
        return (await connection.execute(statement)).first()

    async def take_over(self, seen: Record, claim: Claim) -> Record | None:
        """Claim ``seen`` for a new execution, only if nobody changed it since it was read.

        An expired record starts a new life (token 1, new TTL); a retryable or abandoned one
        keeps its history and bumps the fencing token, so the old owner is fenced off.
        """
        now = self.clock()
        new_life = seen.is_expired(now)
        changes: dict[str, Any] = {
            "request_hash": claim.request_hash,
            "status": Status.IN_PROGRESS.value,
            "owner_id": claim.owner_id,
            "fencing_token": 1 if new_life else records.c.fencing_token + 1,
            "lease_expires_at": now + timedelta(seconds=claim.lease),
            "attempts": 1 if new_life else records.c.attempts + 1,
            "response_status": None,
            "response_headers": None,
            "response_body": None,
            "body_compressed": False,
            "body_omitted": False,
            "updated_at": now,
        }
        if new_life:
            changes |= {"created_at": now, "expires_at": now + timedelta(seconds=claim.ttl)}
        statement = (
            update(records)
            .where(
                _is_key(seen.key),
                records.c.status == seen.status.value,
                records.c.owner_id == seen.owner_id,
                records.c.fencing_token == seen.fencing_token,
            )
            .values(changes)
            .returning(*records.c)
        )
        async with self._connection() as connection:
            row = (await connection.execute(statement)).first()
        return _record_from_row(row) if row is not None else None

    async def renew_lease(self, key: RecordKey, fence: Fence, *, lease: float) -> bool:
        now = self.clock()
        statement = (
            update(records)
            .where(_is_key(key), _is_fenced_by(fence))
            .values(lease_expires_at=now + timedelta(seconds=lease), updated_at=now)
        )
        async with self._connection() as connection:
            result = await connection.execute(statement)
        return bool(result.rowcount)

    async def finalize(
        self, key: RecordKey, fence: Fence, *, status: Status, response: StoredResponse | None
    ) -> bool:
        """Record the outcome; ``False`` means this owner was fenced off and nothing changed."""
        values: dict[str, Any] = {"status": status.value, "updated_at": self.clock()}
        if response is not None:
            body, compressed = _encode_body(response.body)
            values |= {
                "response_status": response.status,
                "response_headers": [list(pair) for pair in response.headers],
                "response_body": body,
                "body_compressed": compressed,
                "body_omitted": response.body_omitted,
            }
        statement = update(records).where(_is_key(key), _is_fenced_by(fence)).values(values)
        async with self._connection() as connection:
            result = await connection.execute(statement)
        return bool(result.rowcount)

    async def get(self, key: RecordKey) -> Record | None:
        async with self._connection() as connection:
            row = (await connection.execute(select(records).where(_is_key(key)))).first()
        return _record_from_row(row) if row is not None else None

    async def delete(self, key: RecordKey) -> bool:
        async with self._connection() as connection:
            result = await connection.execute(delete(records).where(_is_key(key)))
        return bool(result.rowcount)

    async def sweep(self, *, batch_size: int = 1000) -> int:
        """Delete one batch of expired records; returns how many went."""
        expired = (
            select(records.c.scope, records.c.operation, records.c.idempotency_key)
            .where(records.c.expires_at <= self.clock())
            .limit(batch_size)
        )
        if self._is_postgres:
            # SKIP LOCKED lets several sweepers share the work without waiting on each other.
            expired = expired.with_for_update(skip_locked=True)
        key_columns = tuple_(records.c.scope, records.c.operation, records.c.idempotency_key)
        statement = delete(records).where(key_columns.in_(expired))
        async with self._connection() as connection:
            result = await connection.execute(statement)
        return int(result.rowcount or 0)
