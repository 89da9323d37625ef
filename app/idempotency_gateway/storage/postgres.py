"""``PostgresRecordStore``: every statement on one asyncpg pool, on the database's clock.

The request path (reserve, take over, renew lease, finalize, get) and the operators' paths
(admin reads and removals, stuck records, sweeps, breaker overrides, cache invalidations)
run the plain SQL of ``postgres_sql`` on the one pool of the process: no SQLAlchemy compile
or result layer, and asyncpg prepares each statement once per connection (unless
``prepared_statements: false``, for PgBouncer in transaction mode). Only ``open_store``
imports this module, for a ``postgresql://`` URL: it is the one place asyncpg is imported.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta

import asyncpg
import orjson
from asyncpg.pool import PoolConnectionProxy

from idempotency_gateway.clock import Clock
from idempotency_gateway.config import StoreConfig
from idempotency_gateway.database_url import asyncpg_dsn_of
from idempotency_gateway.errors import StoreReadOnly, StoreUnavailable
from idempotency_gateway.storage import postgres_sql as sql
from idempotency_gateway.storage.base import (
    Claim,
    RecordStore,
    Reservation,
    StoredColumns,
    invalidation_from_row,
    record_from_row,
)
from idempotency_gateway.storage.errors import READ_ONLY_DETAIL, Driver, store_errors
from idempotency_gateway.storage.group_commit import GroupCommit
from idempotency_gateway.storage.records import (
    Fence,
    Invalidation,
    Record,
    RecordKey,
    Status,
)

log = logging.getLogger(__name__)

# A table or column the statement names does not exist: a database not migrated to the head.
_SCHEMA_MISSING = frozenset({"42P01", "42703"})

DRIVER = Driver(
    system="postgresql",
    errors=(
        asyncpg.PostgresError,
        asyncpg.InterfaceError,
        # asyncpg's protocol in a state it did not expect: a connection the server ended while
        # it sat idle in the pool (a failover, an operator's pg_terminate_backend), or one
        # that broke mid-statement. A store error like any other, not a crash.
        asyncpg.InternalClientError,
    ),
    schema_missing=lambda exc: getattr(exc, "sqlstate", None) in _SCHEMA_MISSING,
)


async def _keep_session(_connection: asyncpg.Connection) -> None:
    """Release without asyncpg's default reset (advisory unlock, CLOSE ALL, UNLISTEN, RESET
    ALL: a round trip per request). No statement leaves session state behind (the sweep's
    lock is transaction-scoped), and an open transaction is still rolled back by the pool."""


def _json_text(value: object) -> str:
    """JSON by orjson, a few times faster than the standard library's for a header list.
    Stored headers are latin-1 decoded, so there is no lone surrogate for orjson to refuse."""
    return orjson.dumps(value).decode()


async def _decode_json(connection: asyncpg.Connection) -> None:
    await connection.set_type_codec(
        "json", encoder=_json_text, decoder=orjson.loads, schema="pg_catalog"
    )


class PostgresRecordStore(RecordStore):
    def __init__(self, url: str, config: StoreConfig, *, clock: Clock | None = None) -> None:
        super().__init__(clock=clock)
        self._dsn = asyncpg_dsn_of(url)
        self.config = config
        self._pool: asyncpg.Pool | None = None
        self._pool_lock = asyncio.Lock()
        self.reserves: GroupCommit[tuple[RecordKey, Claim], Reservation] | None = None
        self.finalizes: GroupCommit[_Outcome, bool] | None = None
        if config.group_commit:
            batch = config.group_commit_max_batch
            self.reserves = GroupCommit(
                self._reserve_batch, key=_key_of_item, max_batch=batch, follow=_reserved_before
            )
            self.finalizes = GroupCommit(self._finalize_batch, key=_key_of_item, max_batch=batch)

    async def start(self) -> None:
        """Open the pool, and its first ``pool_min_size`` connections, before anything else
        of the gateway uses the database: at the server's connection limit the process holds
        its connections first. A database that does not answer yet leaves the pool to be
        built on first use."""
        try:
            with store_errors("connect", DRIVER):
                await self._get_pool()
        except StoreUnavailable as error:
            log.warning("the store's pool will open on first use: %s", error)

    async def _get_pool(self) -> asyncpg.Pool:
        # Built by start(), else on first use (``open_store`` is synchronous, and a gateway
        # may start before its database is up).
        if self._pool is not None:
            return self._pool
        async with self._pool_lock:
            if self._pool is None:
                self._pool = await asyncpg.create_pool(
                    self._dsn,
                    # A floor the pool keeps (and restores in the background when a
                    # connection is lost): at the server's connection limit these slots stay
                    # the gateway's.
                    min_size=min(self.config.pool_min_size, self.config.pool_size),
                    max_size=self.config.pool_size,
                    reset=_keep_session,
                    init=_decode_json,
                    timeout=self.config.connect_timeout,
                    command_timeout=self.config.statement_timeout,
                    # 0 turns named prepared statements off; PgBouncer in transaction mode
                    # cannot keep them (the next statement may meet another server session).
                    statement_cache_size=100 if self.config.prepared_statements else 0,
                )
            return self._pool

    @asynccontextmanager
    async def _pg(self, operation: str) -> AsyncIterator[PoolConnectionProxy[asyncpg.Record]]:
        with store_errors(operation, DRIVER):
            pool = await self._get_pool()
            # asyncio.timeout rather than acquire(timeout=...): asyncpg applies that one with
            # wait_for, a task of its own per acquire, twice per new key.
            async with asyncio.timeout(self.config.connect_timeout):
                connection = await pool.acquire()
            try:
                yield connection
            except asyncpg.ReadOnlySQLTransactionError:
                # The server became a standby (a failover moved the primary): every pooled
                # connection is on the wrong host. New ones follow the host list to the server
                # that accepts writes (``target_session_attrs=read-write``).
                await pool.expire_connections()
                raise
            except Exception:
                # The statements do not fail in normal operation (a conflict is ON CONFLICT
                # DO NOTHING, a lost compare-and-set is zero rows, the sweep skips locked rows).
                # A failure is a timeout (the host may be gone without a reset ever arriving),
                # a lost connection, a server shutting down, or asyncpg's protocol left
                # mid-message (seen in a failover).
                # The pool would lend the connection out as it is (``_keep_session`` runs no
                # reset query that would notice), so the next statement would hang or fail on
                # it: never reuse it.
                connection.terminate()
                raise
            finally:
                await pool.release(connection)

    async def ping(self) -> None:
        async with self._pg("ping") as connection:
            writable = await connection.fetchval(sql.WRITABLE)
        if not writable:
            raise StoreReadOnly(READ_ONLY_DETAIL)

    async def schema_revision(self) -> str | None:
        async with self._pg("schema") as connection:
            if not await connection.fetchval(sql.MIGRATED):
                return None
            revision = await connection.fetchval(sql.SCHEMA_REVISION)
        return None if revision is None else str(revision)

    async def close(self) -> None:
        if self._pool is not None:
            await self._pool.close()

    def _pin(self) -> datetime | None:
        return self._pinned_clock() if self._pinned_clock is not None else None

    def _key(self, key: RecordKey) -> tuple[str, str, str]:
        return key.tenant, key.operation, key.idempotency_key

    async def reserve(self, key: RecordKey, claim: Claim) -> Reservation:
        """Insert a fresh ``IN_PROGRESS`` row, or return the row that holds the key."""
        if self.reserves is not None:
            return await self.reserves.submit((key, claim))
        args = (*self._key(key), claim.request_hash, claim.owner_id, claim.lease, claim.ttl)
        async with self._pg("reserve") as connection:
            row = await connection.fetchrow(sql.RESERVE, self._pin(), *args)
            if row is None:
                # The holder committed after the reserve's snapshot began: a read sees it.
                row = await connection.fetchrow(sql.SELECT_WITH_NOW, self._pin(), *self._key(key))
        return _reservation(row)

    async def _reserve_batch(
        self, items: Sequence[tuple[RecordKey, Claim]]
    ) -> list[Reservation | StoreUnavailable]:
        """``reserve`` for many keys, in one statement (and a read for any key whose holder
        committed after that statement's snapshot began)."""
        ordered = sorted(items, key=_key_of_item)
        keys = [self._key(key) for key, _ in ordered]
        claims = [(c.request_hash, c.owner_id, c.lease, c.ttl) for _, c in ordered]
        pin = self._pin()
        async with self._pg("reserve") as connection:
            rows = await connection.fetch(
                sql.RESERVE_BATCH, pin, *_columns(keys, 3), *_columns(claims, 4)
            )
            found = {_row_key(row): row for row in rows}
            unseen = [key for key in keys if key not in found]
            if unseen:
                more = await connection.fetch(sql.SELECT_BATCH_WITH_NOW, pin, *_columns(unseen, 3))
                found.update((_row_key(row), row) for row in more)
        answers: list[Reservation | StoreUnavailable] = []
        for key, _ in items:
            try:
                answers.append(_reservation(found.get(self._key(key))))
            except StoreUnavailable as error:
                answers.append(error)
        return answers

    async def take_over(self, seen: Record, claim: Claim) -> Record | None:
        """Claim ``seen`` for a new execution, only if nobody changed it since it was read
        and no owner holds a live lease on it (judged on the database's clock)."""
        async with self._pg("take_over") as connection:
            row = await connection.fetchrow(
                sql.TAKE_OVER,
                self._pin(),
                *self._key(seen.key),
                seen.status.value,
                seen.owner_id,
                seen.fencing_token,
                claim.request_hash,
                claim.owner_id,
                claim.lease,
                claim.ttl,
            )
        return record_from_row(row) if row is not None else None

    async def renew_lease(self, key: RecordKey, fence: Fence, *, lease: float) -> bool:
        async with self._pg("renew_lease") as connection:
            status = await connection.execute(
                sql.RENEW_LEASE,
                self._pin(),
                *self._key(key),
                fence.owner_id,
                fence.fencing_token,
                lease,
            )
        return _changed(status)

    async def _write_outcome(
        self, key: RecordKey, fence: Fence, status: Status, answer: StoredColumns, ttl: float
    ) -> bool:
        if self.finalizes is not None:
            return await self.finalizes.submit(_Outcome(key, fence, status, answer, ttl))
        async with self._pg("finalize") as connection:
            result = await connection.execute(
                sql.FINALIZE,
                self._pin(),
                *self._key(key),
                fence.owner_id,
                fence.fencing_token,
                status.value,
                answer.status,
                answer.headers,
                answer.body,
                answer.compressed,
                answer.omitted,
                ttl,
            )
        return _changed(result)

    async def _finalize_batch(self, outcomes: Sequence[_Outcome]) -> list[bool]:
        """``finalize`` for many keys in one statement; each row is written only where its
        own owner and fencing token match."""
        ordered = sorted(outcomes, key=_key_of_item)
        columns = _columns(
            [
                (
                    *self._key(o.key),
                    o.fence.owner_id,
                    o.fence.fencing_token,
                    o.status.value,
                    o.answer.status,
                    None if o.answer.headers is None else _json_text(o.answer.headers),
                    o.answer.body,
                    o.answer.compressed,
                    o.answer.omitted,
                    o.ttl,
                )
                for o in ordered
            ],
            12,
        )
        async with self._pg("finalize") as connection:
            rows = await connection.fetch(sql.FINALIZE_BATCH, self._pin(), *columns)
        # Ordinals count from 1, in the order sent.
        written = {id(ordered[row["ord"] - 1]) for row in rows}
        return [id(outcome) in written for outcome in outcomes]

    async def release_unsent(self, key: RecordKey, owner_id: str) -> bool:
        async with self._pg("release_unsent") as connection:
            status = await connection.execute(
                sql.RELEASE_UNSENT, self._pin(), *self._key(key), owner_id
            )
        return _changed(status)

    async def get(self, key: RecordKey) -> Record | None:
        async with self._pg("get") as connection:
            row = await connection.fetchrow(sql.SELECT, *self._key(key))
        return record_from_row(row) if row is not None else None

    async def _delete_unless_live(self, key: RecordKey) -> bool:
        async with self._pg("delete") as connection:
            tag = await connection.execute(sql.DELETE_UNLESS_LIVE, self._pin(), *self._key(key))
        return _changed(tag)

    async def _expire_unless_live(self, key: RecordKey) -> bool:
        async with self._pg("expire") as connection:
            tag = await connection.execute(sql.EXPIRE_UNLESS_LIVE, self._pin(), *self._key(key))
        return _changed(tag)

    async def find_by_key(
        self, idempotency_key: str, *, operation: str | None = None, limit: int
    ) -> list[Record]:
        async with self._pg("find_by_key") as connection:
            rows = await connection.fetch(sql.FIND_BY_KEY, idempotency_key, operation, limit)
        return [record_from_row(row) for row in rows]

    async def list_stuck(self, *, limit: int) -> list[Record]:
        async with self._pg("list_stuck") as connection:
            rows = await connection.fetch(sql.LIST_STUCK, self._pin(), limit)
        return [record_from_row(row) for row in rows]

    async def count_stuck(self, *, limit: int) -> int:
        async with self._pg("count_stuck") as connection:
            return int(await connection.fetchval(sql.COUNT_STUCK, self._pin(), limit))

    async def _sweep_batch(self, batch_size: int) -> int | None:
        """A transaction that first takes a transaction-scoped advisory lock: one sweeper at
        a time across every gateway, through PgBouncer in transaction mode too."""
        async with (
            self._pg("sweep") as connection,
            connection.transaction(isolation="read_committed"),
        ):
            if not await connection.fetchval(sql.TRY_SWEEP_LOCK, sql.SWEEP_LOCK_ID):
                return None
            return _rows(await connection.execute(sql.SWEEP_BATCH, self._pin(), batch_size))

    async def set_breaker_override(self, upstream: str, state: str | None, at: datetime) -> None:
        async with self._pg("breaker_override_set") as connection:
            if state is None:
                await connection.execute(sql.CLEAR_BREAKER_OVERRIDE, upstream)
            else:
                await connection.execute(sql.SET_BREAKER_OVERRIDE, upstream, state, at)

    async def breaker_overrides(self) -> dict[str, str]:
        async with self._pg("breaker_override_sync") as connection:
            rows = await connection.fetch(sql.BREAKER_OVERRIDES)
        return {row["upstream"]: row["state"] for row in rows}

    async def publish_invalidation(self, key: RecordKey) -> None:
        async with self._pg("invalidation_publish") as connection:
            await connection.execute(sql.PUBLISH_INVALIDATION, *self._key(key))

    async def newest_invalidations(self, *, within: timedelta) -> tuple[int, set[int]]:
        async with self._pg("invalidation_poll") as connection, connection.transaction():
            newest = await connection.fetchval(sql.NEWEST_INVALIDATION)
            recent = await connection.fetch(sql.RECENT_INVALIDATIONS, within.total_seconds())
        return int(newest), {row["id"] for row in recent}

    async def invalidations_after(
        self, seen: int, *, within: timedelta, keep: timedelta
    ) -> list[Invalidation]:
        async with self._pg("invalidation_poll") as connection, connection.transaction():
            rows = await connection.fetch(sql.INVALIDATIONS_AFTER, seen, within.total_seconds())
            await connection.execute(sql.PRUNE_INVALIDATIONS, keep.total_seconds())
        return [invalidation_from_row(row) for row in rows]


@dataclass(frozen=True, slots=True)
class _Outcome:
    """One finalize waiting for its batch."""

    key: RecordKey
    fence: Fence
    status: Status
    answer: StoredColumns
    ttl: float


def _key_of_item(item: tuple[RecordKey, Claim] | _Outcome) -> tuple[str, str, str]:
    """The key a batch holds at most once, and the order every gateway sends keys in."""
    key = item.key if isinstance(item, _Outcome) else item[0]
    return key.tenant, key.operation, key.idempotency_key


def _reserved_before(_: tuple[RecordKey, Claim], first: Reservation) -> Reservation:
    """A second reserve of ``first``'s key in one batch, answered as a statement run the
    instant after ``first``'s would be: it finds the row ``first`` left, held by its owner.
    Both callers were waiting at once, so no caller can tell that order from any other."""
    return dataclasses.replace(first, reserved=False)


def _columns(rows: Sequence[tuple[object, ...]], width: int) -> list[list[object]]:
    """Rows as the arrays ``unnest`` takes, one per column."""
    return [[row[i] for row in rows] for i in range(width)]


def _row_key(row: asyncpg.Record) -> tuple[str, str, str]:
    return row["scope"], row["operation"], row["idempotency_key"]


def _reservation(row: asyncpg.Record | None) -> Reservation:
    if row is None:
        # Deleted between our insert and read: rare enough that the caller just retries.
        raise StoreUnavailable("the record vanished while being reserved; retry")
    return Reservation(record_from_row(row), row["reserved"], row["db_now"])


def _rows(command_tag: str) -> int:
    """asyncpg answers a DELETE or UPDATE with its command tag, ``DELETE <rows>``."""
    return int(command_tag.rpartition(" ")[2])


def _changed(command_tag: str) -> bool:
    return _rows(command_tag) > 0
