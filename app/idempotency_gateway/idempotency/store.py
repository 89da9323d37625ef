"""``RecordStore``: every transition of a record is one atomic SQL statement.

One code path through SQLAlchemy Core serves PostgreSQL (asyncpg) and SQLite (aiosqlite). The
store decides nothing: it runs compare-and-set statements and reports whether they matched;
``idempotency_gateway.idempotency.machine`` decides what a record means.

Round trips on the hot path: a new key costs one reserve and one finalize; a duplicate costs
one statement (on PostgreSQL the reserve returns the existing row in the same round trip).
Statements run in autocommit mode, so none pays for a separate BEGIN and COMMIT.
"""

from __future__ import annotations

import asyncio
import time
import zlib
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import (
    ColumnElement,
    Row,
    delete,
    event,
    func,
    literal,
    select,
    tuple_,
)
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from idempotency_gateway.config import StoreConfig
from idempotency_gateway.errors import StoreUnavailable
from idempotency_gateway.idempotency import statements
from idempotency_gateway.idempotency.record import Fence, Record, RecordKey, Status, StoredResponse
from idempotency_gateway.idempotency.schema import records
from idempotency_gateway.telemetry.metrics import STORE_ERRORS, STORE_LATENCY

Clock = Callable[[], datetime]

# Any fixed number, the same in every gateway: the key of the sweepers' advisory lock.
SWEEP_LOCK_ID = 0x1DE4_9A7E

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


def _fence_params(fence: Fence) -> dict[str, Any]:
    return {"f_owner": fence.owner_id, "f_token": fence.fencing_token}


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
    async def _connection(self, operation: str) -> AsyncIterator[AsyncConnection]:
        """The one place where driver and pool errors become ``StoreUnavailable``; every
        statement's latency and failures are measured here too."""
        started = time.perf_counter()
        try:
            async with self.engine.connect() as connection:
                yield connection
        except (SQLAlchemyError, OSError, TimeoutError) as exc:
            STORE_ERRORS.labels(operation).inc()
            raise StoreUnavailable(f"idempotency store error: {type(exc).__name__}") from exc
        finally:
            STORE_LATENCY.labels(operation).observe(time.perf_counter() - started)

    async def ping(self) -> None:
        async with self._connection("ping") as connection:
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
        async with self._connection("reserve") as connection:
            if self._is_postgres:
                result = await connection.execute(
                    statements.RESERVE_POSTGRES, values | statements.key_params(key)
                )
                row = result.first()
                if row is not None:
                    return Reservation(_record_from_row(row), reserved=row.reserved)
            else:
                row = (await connection.execute(statements.RESERVE_SQLITE, values)).first()
                if row is not None:
                    return Reservation(_record_from_row(row), reserved=True)
            # The holder committed after this statement's snapshot began (PostgreSQL) or the
            # insert lost (SQLite): a plain read now sees it.
            existing = (
                await connection.execute(statements.SELECT_RECORD, statements.key_params(key))
            ).first()
        if existing is None:
            # Deleted between our insert and read: rare enough that the caller just retries.
            raise StoreUnavailable("the record vanished while being reserved; retry")
        return Reservation(_record_from_row(existing), reserved=False)

    async def take_over(self, seen: Record, claim: Claim) -> Record | None:
        """Claim ``seen`` for a new execution, only if nobody changed it since it was read.

        An expired record starts a new life (token 1, new TTL); a retryable or abandoned one
        keeps its history and bumps the fencing token, so the old owner is fenced off.
        """
        now = self.clock()
        params: dict[str, Any] = statements.key_params(seen.key) | {
            "s_status": seen.status.value,
            "s_owner": seen.owner_id,
            "s_token": seen.fencing_token,
            "t_request_hash": claim.request_hash,
            "t_owner": claim.owner_id,
            "t_lease_expires_at": now + timedelta(seconds=claim.lease),
            "t_now": now,
        }
        statement = statements.TAKE_OVER
        if seen.is_expired(now):
            statement = statements.TAKE_OVER_EXPIRED
            params |= {"t_now2": now, "t_expires_at": now + timedelta(seconds=claim.ttl)}
        async with self._connection("take_over") as connection:
            row = (await connection.execute(statement, params)).first()
        return _record_from_row(row) if row is not None else None

    async def renew_lease(self, key: RecordKey, fence: Fence, *, lease: float) -> bool:
        now = self.clock()
        params = statements.key_params(key) | _fence_params(fence)
        params |= {"r_lease_expires_at": now + timedelta(seconds=lease), "r_now": now}
        async with self._connection("renew_lease") as connection:
            result = await connection.execute(statements.RENEW_LEASE, params)
        return bool(result.rowcount)

    async def finalize(
        self, key: RecordKey, fence: Fence, *, status: Status, response: StoredResponse | None
    ) -> bool:
        """Record the outcome; ``False`` means this owner was fenced off and nothing changed."""
        params: dict[str, Any] = statements.key_params(key) | _fence_params(fence)
        params |= {"u_status": status.value, "u_now": self.clock()}
        if response is None:
            params |= {
                "u_response_status": None,
                "u_response_headers": None,
                "u_response_body": None,
                "u_body_compressed": False,
                "u_body_omitted": False,
            }
        else:
            body, compressed = _encode_body(response.body)
            params |= {
                "u_response_status": response.status,
                "u_response_headers": [list(pair) for pair in response.headers],
                "u_response_body": body,
                "u_body_compressed": compressed,
                "u_body_omitted": response.body_omitted,
            }
        async with self._connection("finalize") as connection:
            result = await connection.execute(statements.FINALIZE, params)
        return bool(result.rowcount)

    async def get(self, key: RecordKey) -> Record | None:
        async with self._connection("get") as connection:
            result = await connection.execute(statements.SELECT_RECORD, statements.key_params(key))
            row = result.first()
        return _record_from_row(row) if row is not None else None

    async def delete(self, key: RecordKey) -> bool:
        async with self._connection("delete") as connection:
            result = await connection.execute(statements.DELETE_RECORD, statements.key_params(key))
        return bool(result.rowcount)

    async def expire(self, key: RecordKey) -> bool:
        """Make a record count as absent now (it stays readable until swept)."""
        now = self.clock()
        params = statements.key_params(key) | {"e_now": now, "e_now2": now}
        async with self._connection("expire") as connection:
            result = await connection.execute(statements.EXPIRE_RECORD, params)
        return bool(result.rowcount)

    async def list_stuck(self, *, limit: int) -> list[Record]:
        """``IN_PROGRESS`` records whose owner's lease ran out: owners that died or stalled."""
        statement = (
            select(records).where(*self._stuck()).order_by(records.c.lease_expires_at).limit(limit)
        )
        async with self._connection("list_stuck") as connection:
            rows = (await connection.execute(statement)).all()
        return [_record_from_row(row) for row in rows]

    async def count_stuck(self, *, limit: int) -> int:
        """How many records ``list_stuck`` would list, counting no further than ``limit``:
        sampled for a gauge, it must stay cheap however many owners died."""
        stuck = select(literal(1)).where(*self._stuck()).limit(limit).subquery()
        async with self._connection("count_stuck") as connection:
            return int((await connection.execute(select(func.count()).select_from(stuck))).one()[0])

    def _stuck(self) -> tuple[ColumnElement[bool], ...]:
        return (
            records.c.status == Status.IN_PROGRESS.value,
            records.c.lease_expires_at <= self.clock(),
        )

    async def sweep(self, *, batch_size: int = 1000, max_batches: int | None = None) -> int | None:
        """Delete expired records in batches until none are left (or ``max_batches`` ran);
        ``None`` when another sweeper holds the lock (a PostgreSQL advisory lock: one sweeper
        at a time across every gateway)."""
        expired = (
            select(records.c.scope, records.c.operation, records.c.idempotency_key)
            .where(records.c.expires_at <= self.clock())
            .limit(batch_size)
        )
        if self._is_postgres:
            # Skips rows an owner is finalizing right now instead of waiting on them.
            expired = expired.with_for_update(skip_locked=True)
        key_columns = tuple_(records.c.scope, records.c.operation, records.c.idempotency_key)
        batch = delete(records).where(key_columns.in_(expired))
        total = 0
        async with self._connection("sweep") as connection:
            if self._is_postgres:
                lock = select(func.pg_try_advisory_lock(SWEEP_LOCK_ID))
                if not (await connection.execute(lock)).scalar():
                    return None
            try:
                batches = 0
                while True:
                    deleted = int((await connection.execute(batch)).rowcount or 0)
                    total += deleted
                    batches += 1
                    if deleted < batch_size or batches == max_batches:
                        return total
                    # Small statements with pauses between them: the sweeper never hogs
                    # the database the request path needs.
                    await asyncio.sleep(0)
            finally:
                if self._is_postgres:
                    await connection.execute(select(func.pg_advisory_unlock(SWEEP_LOCK_ID)))
