"""``RecordStore``: every transition of a record is one atomic SQL statement.

``RecordStore.from_url`` picks the backend, and each runs its hot statements (reserve, take
over, renew lease, finalize, get) as plain SQL on its driver directly: ``PostgresRecordStore``
on asyncpg, on the database's clock; ``SqliteRecordStore`` on ``sqlite3`` in a thread of its
own, on the host clock (one machine). Both keep one contract, proved by one test suite. The
admin and sweep paths, here, run through SQLAlchemy on both. The store decides nothing: it
runs compare-and-set statements and reports whether they matched;
``idempotency_gateway.idempotency.machine`` decides what a record means.

Round trips on the hot path: a new key costs one reserve and one finalize; a duplicate costs
one statement on PostgreSQL (the reserve returns the existing row in the same round trip).
Statements run in autocommit mode, so none pays for a separate BEGIN and COMMIT.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
import zlib
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager, contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import Enum, auto
from typing import Any, Protocol

from sqlalchemy import (
    ColumnElement,
    Delete,
    Update,
    and_,
    delete,
    event,
    func,
    inspect,
    literal,
    or_,
    select,
    text,
    tuple_,
    update,
)
from sqlalchemy.engine import ExceptionContext
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine
from sqlalchemy.sql.functions import now as db_now

from idempotency_gateway.clock import Clock, utc_now
from idempotency_gateway.config import StoreConfig
from idempotency_gateway.database_url import asyncpg_dsn_of as asyncpg_dsn_of
from idempotency_gateway.database_url import normalize_database_url as normalize_database_url
from idempotency_gateway.database_url import sqlalchemy_url
from idempotency_gateway.errors import StoreReadOnly, StoreUnavailable
from idempotency_gateway.storage.records import Fence, Record, RecordKey, Status, StoredResponse
from idempotency_gateway.storage.schema import records
from idempotency_gateway.storage.sqlite_sql import PRAGMAS as SQLITE_PRAGMAS
from idempotency_gateway.telemetry import tracing
from idempotency_gateway.telemetry.degradation import DegradationLog
from idempotency_gateway.telemetry.metrics import STORE_ERRORS, STORE_LATENCY, Children

# Any fixed number, the same in every gateway: the key of the sweepers' advisory lock.
SWEEP_LOCK_ID = 0x1DE4_9A7E

# Connections for the admin and sweep paths: a few at a time, never the request path's load.
_ADMIN_POOL_SIZE = 2

# "cannot execute ... in a read-only transaction": a hot standby refusing a write.
READ_ONLY_SQLSTATE = "25006"

# Bodies below this size are stored as they are: compressing them saves nothing worth a CPU.
_COMPRESS_FROM = 1024


class Removal(Enum):
    """What an operator's delete or expire of a record did."""

    DONE = auto()
    ABSENT = auto()
    IN_FLIGHT = auto()
    """Refused: an owner holds a live lease and may be executing the request right now."""


@dataclass(frozen=True, slots=True)
class Claim:
    """What an execution asks for when it reserves or takes over a record."""

    request_hash: str
    owner_id: str
    lease: float
    ttl: float


@dataclass(frozen=True, slots=True)
class Reservation:
    """The outcome of a reserve: our fresh row, or the row that was already there, and the
    store's "now" to judge that row by (the database's clock on PostgreSQL)."""

    record: Record
    reserved: bool
    now: datetime


def _aware(moment: datetime) -> datetime:
    # SQLite hands back naive datetimes; every time the store writes is UTC.
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


def encode_body(body: bytes) -> tuple[bytes, bool]:
    if len(body) < _COMPRESS_FROM:
        return body, False
    compressed = zlib.compress(body, 1)
    if len(compressed) >= len(body):
        return body, False
    return compressed, True


@dataclass(frozen=True, slots=True)
class StoredColumns:
    """An outcome's answer as the ``response_*`` and body columns hold it (all empty when the
    outcome has no answer); the body is compressed when that pays."""

    status: int | None = None
    headers: list[list[str]] | None = None
    body: bytes | None = None
    compressed: bool = False
    omitted: bool = False

    @classmethod
    def of(cls, response: StoredResponse | None) -> StoredColumns:
        if response is None:
            return cls()
        body, compressed = encode_body(response.body)
        headers = [list(pair) for pair in response.headers]
        return cls(response.status, headers, body, compressed, response.body_omitted)


class Row(Protocol):
    """A result row by column name: SQLAlchemy's ``row._mapping`` or an asyncpg record."""

    def __getitem__(self, name: str) -> Any: ...


def record_from_row(data: Row) -> Record:
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


def _key_matches(key: RecordKey) -> ColumnElement[bool]:
    return and_(
        records.c.scope == key.scope,
        records.c.operation == key.operation,
        records.c.idempotency_key == key.idempotency_key,
    )


def create_engine_for(url: str, config: StoreConfig) -> AsyncEngine:
    parsed = sqlalchemy_url(url)
    if parsed.get_backend_name() == "sqlite":
        engine = create_async_engine(
            parsed,
            isolation_level="AUTOCOMMIT",
            connect_args={"timeout": config.statement_timeout},
        )
        _tune_sqlite(engine)
        return engine
    connect_args: dict[str, Any] = {
        "timeout": config.connect_timeout,
        "command_timeout": config.statement_timeout,
    }
    if not config.prepared_statements:
        # Unnamed statements only, for PgBouncer in transaction mode: with asyncpg's cache off
        # its prepare() is unnamed, and SQLAlchemy must not keep prepared statements either (a
        # kept one would be bound on whichever server connection PgBouncer hands out next).
        connect_args |= {"statement_cache_size": 0, "prepared_statement_cache_size": 0}
    engine = create_async_engine(
        parsed,
        isolation_level="AUTOCOMMIT",
        # Only the admin, sweep and breaker-override paths use this pool on PostgreSQL; the
        # request path has an asyncpg pool of ``pool_size`` of its own.
        pool_size=_ADMIN_POOL_SIZE,
        max_overflow=0,
        pool_timeout=config.connect_timeout,
        # A connection idle since a failover may point at a dead host: test it on checkout
        # (the admin paths are rare, the round trip is cheap).
        pool_pre_ping=True,
        connect_args=connect_args,
    )
    _drop_on_read_only(engine)
    return engine


def _drop_on_read_only(engine: AsyncEngine) -> None:
    """A write refused as read-only means the connection is on a server that is (now) a
    standby: treat it like a lost connection, so SQLAlchemy drops every connection made
    before it and the next checkout connects to the host that accepts writes."""

    @event.listens_for(engine.sync_engine, "handle_error")
    def _on_error(context: ExceptionContext) -> None:
        if getattr(context.original_exception, "sqlstate", None) == READ_ONLY_SQLSTATE:
            context.is_disconnect = True


def _tune_sqlite(engine: AsyncEngine) -> None:
    @event.listens_for(engine.sync_engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        cursor = dbapi_connection.cursor()
        for pragma in SQLITE_PRAGMAS:
            cursor.execute(pragma)
        cursor.close()


def _driver_errors() -> tuple[type[BaseException], ...]:
    """Every error a driver or pool can raise for a store that is down, slow or misbehaving."""
    errors: tuple[type[BaseException], ...] = (
        SQLAlchemyError,
        sqlite3.Error,
        OSError,
        TimeoutError,
    )
    try:
        import asyncpg
    except ModuleNotFoundError:  # no [postgres] extra: no asyncpg error can be raised
        return errors
    return (
        *errors,
        asyncpg.PostgresError,
        asyncpg.InterfaceError,
        # asyncpg's protocol in a state it did not expect: a connection the server ended while
        # it sat idle in the pool (a failover, an operator's pg_terminate_backend), or one that
        # broke mid-statement. A store error like any other, not a crash.
        asyncpg.InternalClientError,
    )


_DRIVER_ERRORS = _driver_errors()


_store_errors = Children(STORE_ERRORS)
# One log per statement kind, so a failing admin read cannot hide why reserves fail.
_store_degradations: dict[str, DegradationLog] = {}
_store_latency = Children(STORE_LATENCY)


# SQLSTATEs: a write on a standby (or a database or session set read-only); a connection
# over the server's, the database's or the role's limit.
_READ_ONLY = "25006"
_TOO_MANY_CONNECTIONS = "53300"
# A table or column the statement names does not exist: a database not migrated to the head.
_SCHEMA_MISSING = frozenset({"42P01", "42703"})
SCHEMA_MISSING_DETAIL = (
    "the idempotency store's tables are missing or out of date; the database must be "
    "migrated (idempotency-gateway migrate)"
)
READ_ONLY_DETAIL = (
    "the idempotency store is read-only (a standby, or a database set read-only); keyed "
    "requests are refused until a writable primary answers"
)


def _sqlstate(exc: BaseException) -> str | None:
    """The SQLSTATE a driver error carries (SQLAlchemy keeps asyncpg's error in ``orig``)."""
    seen: BaseException | None = exc
    for _ in range(4):
        if seen is None:
            return None
        sqlstate = getattr(seen, "sqlstate", None)
        if isinstance(sqlstate, str):
            return sqlstate
        seen = getattr(seen, "orig", None) or seen.__cause__
    return None


def _driver_error(exc: BaseException) -> BaseException:
    """The driver's own exception (asyncpg's, sqlite3's) under SQLAlchemy's wrappers."""
    seen = exc
    for _ in range(4):
        inner = getattr(seen, "orig", None) or seen.__cause__
        if inner is None:
            break
        seen = inner
    return seen


def _sqlite_schema_missing(exc: BaseException) -> bool:
    """SQLite has no SQLSTATE: its message says so ("no such table", "no such column")."""
    cause = getattr(exc, "orig", None) or exc
    return isinstance(cause, sqlite3.OperationalError) and str(cause).startswith("no such ")


def _unavailable(exc: BaseException) -> StoreUnavailable:
    """The client's problem says what is wrong in the gateway's terms; the driver's class
    stays in the exception chain and the logs, out of the answer."""
    if _sqlstate(exc) == _READ_ONLY:
        return StoreReadOnly(READ_ONLY_DETAIL)
    if _sqlstate(exc) == _TOO_MANY_CONNECTIONS:
        return StoreUnavailable("the idempotency store has no connection to spare")
    if _sqlstate(exc) in _SCHEMA_MISSING or _sqlite_schema_missing(exc):
        return StoreUnavailable(SCHEMA_MISSING_DETAIL)
    if isinstance(exc, TimeoutError):
        return StoreUnavailable("the idempotency store did not answer in time")
    return StoreUnavailable("the idempotency store is unreachable or failed")


@contextmanager
def store_errors(operation: str, system: str) -> Iterator[None]:
    """The one place where driver and pool errors become ``StoreUnavailable``, for every
    backend and the admin paths too; every statement's latency and failures are measured,
    and traced (``system``: ``postgresql`` or ``sqlite``), here as well."""
    span = tracing.store_span(operation, system)
    started = time.perf_counter()
    try:
        yield
    except _DRIVER_ERRORS as exc:
        _store_errors(operation).inc()
        # The driver's class and message go to the log, never into a client's problem.
        degradation = _store_degradations.get(operation)
        if degradation is None:
            degradation = _store_degradations[operation] = DegradationLog(
                f"idempotency store ({operation})", fallback="answering store-unavailable"
            )
        degradation.failed(_driver_error(exc))
        error = _unavailable(exc)
        if span is not None:
            span.fail(error)
        raise error from exc
    finally:
        _store_latency(operation).observe(time.perf_counter() - started)
        if span is not None:
            span.end()


@asynccontextmanager
async def store_connection(engine: AsyncEngine, operation: str) -> AsyncIterator[AsyncConnection]:
    """A connection for one SQLAlchemy-side operation (admin, sweep, operator tables), its
    errors translated and measured by ``store_errors``."""
    with store_errors(operation, engine.dialect.name):
        async with engine.connect() as connection:
            yield connection


class RecordStore(ABC):
    """The durable home of idempotency records, shared by every gateway on one database.

    Build it with ``RecordStore.from_url(url, StoreConfig())`` on a database migrated to the
    head (``idempotency-gateway migrate``), and ``await store.close()`` when done. Leases and
    expiry are judged by one clock: the database's on PostgreSQL (gateway hosts may disagree
    about the time), the host's on SQLite. ``clock`` pins the time instead; it exists for
    tests that move time by hand, never for production.

    A database that does not answer surfaces as ``StoreUnavailable`` from every method, never
    as a driver's own exception (``store_errors``). The store decides nothing about a record's
    meaning: its compare-and-set writes report whether they matched, and ``machine`` decides.
    """

    def __init__(self, engine: AsyncEngine, *, clock: Clock | None = None) -> None:
        self.engine = engine
        self._pinned_clock = clock
        self.clock: Clock = clock or utc_now
        self._is_postgres = engine.dialect.name == "postgresql"

    @classmethod
    def from_url(cls, url: str, config: StoreConfig, *, clock: Clock | None = None) -> RecordStore:
        engine = create_engine_for(url, config)
        if engine.dialect.name == "postgresql":
            # Imported here: both backends build on this class.
            from idempotency_gateway.storage.postgres import PostgresRecordStore

            return PostgresRecordStore(engine, config, clock=clock)
        from idempotency_gateway.storage.sqlite import SqliteRecordStore

        return SqliteRecordStore(engine, engine.url.database or ":memory:", clock=clock)

    async def close(self) -> None:
        await self.engine.dispose()

    def _now_sql(self) -> ColumnElement[Any]:
        """ "Now" inside a statement: the database's clock on PostgreSQL unless pinned."""
        if self._is_postgres and self._pinned_clock is None:
            return db_now()
        return literal(self.clock())

    def _connection(self, operation: str) -> AbstractAsyncContextManager[AsyncConnection]:
        return store_connection(self.engine, operation)

    @abstractmethod
    async def start(self) -> None:
        """Open what the request path needs ahead of any other use of the database; a store
        that does not answer yet is opened on first use instead."""

    async def ping(self) -> None:
        """Raise ``StoreUnavailable`` unless the request path can write now: a connection
        of its own, on a database that takes writes (``StoreReadOnly`` when it does not)."""
        async with self._connection("ping") as connection:
            await connection.execute(select(literal(1)))

    async def schema_revision(self) -> str | None:
        """The Alembic revision the database is at; ``None`` before the first migration."""
        async with self._connection("schema") as connection:
            migrated = await connection.run_sync(
                lambda sync: inspect(sync).has_table("alembic_version")
            )
            if not migrated:
                return None
            revision = await connection.scalar(text("SELECT version_num FROM alembic_version"))
        return None if revision is None else str(revision)

    @abstractmethod
    async def reserve(self, key: RecordKey, claim: Claim) -> Reservation:
        """Insert a fresh ``IN_PROGRESS`` row, or return the row that holds the key."""

    @abstractmethod
    async def take_over(self, seen: Record, claim: Claim) -> Record | None:
        """Claim ``seen`` for a new execution, only if nobody changed it since it was read
        and no owner holds a live lease on it. An expired record starts a new life (new TTL,
        attempts from 1); a retryable or abandoned one keeps its history. Either way the new
        owner's token is the database's next, so the old owner is fenced off."""

    @abstractmethod
    async def renew_lease(self, key: RecordKey, fence: Fence, *, lease: float) -> bool:
        """Extend the owner's lease; ``False`` means this owner was fenced off."""

    async def finalize(
        self,
        key: RecordKey,
        fence: Fence,
        *,
        status: Status,
        response: StoredResponse | None,
        ttl: float,
    ) -> bool:
        """Record the outcome; ``False`` means this owner was fenced off and nothing changed.
        A record already past its expiry (a live execution outlived it) is kept ``ttl``
        seconds from now, so its answer can be replayed."""
        return await self._write_outcome(key, fence, status, StoredColumns.of(response), ttl)

    @abstractmethod
    async def _write_outcome(
        self, key: RecordKey, fence: Fence, status: Status, answer: StoredColumns, ttl: float
    ) -> bool:
        """``finalize`` as the backend runs it."""

    @abstractmethod
    async def release_unsent(self, key: RecordKey, owner_id: str) -> bool:
        """Give back a claim whose owner never sent anything (its reserve or take-over
        committed after the gateway stopped waiting for it): the ``IN_PROGRESS`` row of
        ``owner_id`` becomes ``FAILED_RETRYABLE``, which the next request with the key takes
        over and executes. ``False``: no such row (the claim never committed, or another
        owner holds the record now) and nothing changed."""

    @abstractmethod
    async def get(self, key: RecordKey) -> Record | None: ...

    async def delete(self, key: RecordKey) -> Removal:
        """Delete a record, unless it is in flight under a live lease."""
        statement = delete(records).where(_key_matches(key), self._not_live())
        return await self._remove(key, statement, "delete")

    async def expire(self, key: RecordKey) -> Removal:
        """Make a record count as absent now (it stays readable until swept), unless it is
        in flight under a live lease."""
        now = self._now_sql()
        statement = (
            update(records)
            .where(_key_matches(key), self._not_live())
            .values(expires_at=now, updated_at=now)
        )
        return await self._remove(key, statement, "expire")

    async def _remove(self, key: RecordKey, statement: Delete | Update, operation: str) -> Removal:
        """Run a delete or expire that spares a live execution: removed under its owner,
        the record would let a duplicate execute beside the owner's attempt, which its
        lease lets it send without asking the database again."""
        async with self._connection(operation) as connection:
            result = await connection.execute(statement)
        if result.rowcount:
            return Removal.DONE
        return Removal.ABSENT if await self.get(key) is None else Removal.IN_FLIGHT

    def _not_live(self) -> ColumnElement[bool]:
        """Not an execution in flight: no owner holds a live lease on the record."""
        return or_(
            records.c.status != Status.IN_PROGRESS.value,
            records.c.lease_expires_at <= self._now_sql(),
        )

    async def find_by_key(
        self, idempotency_key: str, *, operation: str | None = None, limit: int
    ) -> list[Record]:
        """Records of ``idempotency_key`` in every scope (of ``operation`` only, if given),
        newest first: an operator who has a key but not the client's scope hash."""
        statement = select(records).where(records.c.idempotency_key == idempotency_key)
        if operation is not None:
            statement = statement.where(records.c.operation == operation)
        statement = statement.order_by(records.c.created_at.desc()).limit(limit)
        async with self._connection("find_by_key") as connection:
            rows = (await connection.execute(statement)).all()
        return [record_from_row(row._mapping) for row in rows]

    async def list_stuck(self, *, limit: int) -> list[Record]:
        """``IN_PROGRESS`` records whose owner's lease ran out: owners that died or stalled."""
        statement = (
            select(records).where(*self._stuck()).order_by(records.c.lease_expires_at).limit(limit)
        )
        async with self._connection("list_stuck") as connection:
            rows = (await connection.execute(statement)).all()
        return [record_from_row(row._mapping) for row in rows]

    async def count_stuck(self, *, limit: int) -> int:
        """How many records ``list_stuck`` would list, counting no further than ``limit``:
        sampled for a gauge, it must stay cheap however many owners died."""
        stuck = select(literal(1)).where(*self._stuck()).limit(limit).subquery()
        async with self._connection("count_stuck") as connection:
            return int((await connection.execute(select(func.count()).select_from(stuck))).one()[0])

    def _stuck(self) -> tuple[ColumnElement[bool], ...]:
        return (
            records.c.status == Status.IN_PROGRESS.value,
            records.c.lease_expires_at <= self._now_sql(),
        )

    async def sweep(self, *, batch_size: int = 1000, max_batches: int | None = None) -> int | None:
        """Delete expired records in batches until none are left (or ``max_batches`` ran);
        ``None`` when another sweeper is at work. A live execution is never deleted.

        On PostgreSQL each batch is a transaction that first takes a transaction-scoped
        advisory lock: one sweeper at a time across every gateway, and the lock holds through
        PgBouncer in transaction mode (a session lock would not: the next statement may run
        on another server connection)."""
        now = self._now_sql()
        expired = (
            select(records.c.scope, records.c.operation, records.c.idempotency_key)
            # Never a live execution, whatever its TTL says.
            .where(records.c.expires_at <= now, self._not_live())
            .limit(batch_size)
        )
        if self._is_postgres:
            # Skips rows an owner is finalizing right now instead of waiting on them.
            expired = expired.with_for_update(skip_locked=True)
        key_columns = tuple_(records.c.scope, records.c.operation, records.c.idempotency_key)
        batch = delete(records).where(key_columns.in_(expired))
        lock = select(func.pg_try_advisory_xact_lock(SWEEP_LOCK_ID))
        total = 0
        batches = 0
        async with self._connection("sweep") as connection:
            if self._is_postgres:
                connection = await connection.execution_options(isolation_level="READ COMMITTED")
            while True:
                async with connection.begin():
                    if self._is_postgres and not (await connection.execute(lock)).scalar():
                        return None if batches == 0 else total
                    deleted = int((await connection.execute(batch)).rowcount or 0)
                total += deleted
                batches += 1
                if deleted < batch_size or batches == max_batches:
                    return total
                # Small transactions with pauses between them: the sweeper never hogs the
                # database the request path needs.
                await asyncio.sleep(0)
