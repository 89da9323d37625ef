"""``RecordStore``: every transition of a record is one atomic SQL statement.

``open_store`` (``storage.backends``) picks the backend from the URL, and each runs all of
its SQL, the operators' included, on its native driver: ``PostgresRecordStore`` on one
asyncpg pool, on the database's clock; ``SqliteRecordStore`` on ``sqlite3`` in a thread of
its own, on the host clock (one machine). Both keep one contract, proved by one test suite.
The store decides nothing: it runs compare-and-set statements and reports whether they
matched; ``idempotency_gateway.idempotency.machine`` decides what a record means.

Round trips on the hot path: a new key costs one reserve and one finalize; a duplicate costs
one statement on PostgreSQL (the reserve returns the existing row in the same round trip).
Statements run in autocommit mode, so none pays for a separate BEGIN and COMMIT. On PostgreSQL
the reserves, and the finalizes, of one event-loop iteration share one statement (group commit,
``storage.group_commit``), each caller still getting its own statement's answer.

This module imports no driver: a library user pays only for the backend the URL names.
"""

from __future__ import annotations

import asyncio
import zlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import Enum, auto
from typing import Any, ClassVar, Protocol

from idempotency_gateway.clock import Clock, utc_now
from idempotency_gateway.config import StoreConfig
from idempotency_gateway.storage.errors import READ_ONLY_DETAIL as READ_ONLY_DETAIL
from idempotency_gateway.storage.errors import SCHEMA_MISSING_DETAIL as SCHEMA_MISSING_DETAIL
from idempotency_gateway.storage.records import (
    Fence,
    Invalidation,
    Record,
    RecordKey,
    Status,
    StoredResponse,
)

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
    """A result row by column name: an asyncpg record, or a dict of a ``sqlite3`` row."""

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
        lease_expires_at=data["lease_expires_at"],
        response=response,
        attempts=data["attempts"],
        created_at=data["created_at"],
        updated_at=data["updated_at"],
        expires_at=data["expires_at"],
    )


def invalidation_from_row(data: Row) -> Invalidation:
    key = RecordKey(data["scope"], data["operation"], data["idempotency_key"])
    return Invalidation(data["id"], key)


class StoreOpener(Protocol):
    def __call__(self, url: str, config: StoreConfig, *, clock: Clock | None = None) -> RecordStore:
        """The store at ``url`` (``storage.open_store``)."""
        ...


class RecordStore(ABC):
    """The durable home of idempotency records, shared by every gateway on one database.

    Open it with ``open_store(url, StoreConfig())`` on a database migrated to the head
    (``idempotency-gateway migrate``), and ``await store.close()`` when done. Leases and
    expiry are judged by one clock: the database's on PostgreSQL (gateway hosts may disagree
    about the time), the host's on SQLite. ``clock`` pins the time instead; it exists for
    tests that move time by hand, never for production.

    A database that does not answer surfaces as ``StoreUnavailable`` from every method, never
    as a driver's own exception (``storage.errors.store_errors``). The store decides nothing
    about a record's meaning: its compare-and-set writes report whether they matched, and
    ``machine`` decides.
    """

    def __init__(self, *, clock: Clock | None = None) -> None:
        self._pinned_clock = clock
        self.clock: Clock = clock or utc_now

    # Deprecated for ``open_store``, kept one release; set by ``storage.backends``, which the
    # storage package imports first (see there).
    from_url: ClassVar[StoreOpener]

    @abstractmethod
    async def start(self) -> None:
        """Open what the request path needs ahead of any other use of the database; a store
        that does not answer yet is opened on first use instead."""

    @abstractmethod
    async def close(self) -> None: ...

    @abstractmethod
    async def ping(self) -> None:
        """Raise ``StoreUnavailable`` unless the request path can write now: a connection
        of its own, on a database that takes writes (``StoreReadOnly`` when it does not)."""

    @abstractmethod
    async def schema_revision(self) -> str | None:
        """The Alembic revision the database is at; ``None`` before the first migration."""

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
        return await self._removal(key, await self._delete_unless_live(key))

    async def expire(self, key: RecordKey) -> Removal:
        """Make a record count as absent now (it stays readable until swept), unless it is
        in flight under a live lease."""
        return await self._removal(key, await self._expire_unless_live(key))

    async def _removal(self, key: RecordKey, removed: bool) -> Removal:
        """A delete or expire spares a live execution: removed under its owner, the record
        would let a duplicate execute beside the owner's attempt, which its lease lets it
        send without asking the database again."""
        if removed:
            return Removal.DONE
        return Removal.ABSENT if await self.get(key) is None else Removal.IN_FLIGHT

    @abstractmethod
    async def _delete_unless_live(self, key: RecordKey) -> bool:
        """Delete the record unless an owner holds a live lease on it; whether a row went."""

    @abstractmethod
    async def _expire_unless_live(self, key: RecordKey) -> bool:
        """Set the record's expiry to now unless an owner holds a live lease on it."""

    @abstractmethod
    async def find_by_key(
        self, idempotency_key: str, *, operation: str | None = None, limit: int
    ) -> list[Record]:
        """Records of ``idempotency_key`` in every scope (of ``operation`` only, if given),
        newest first: an operator who has a key but not the client's scope hash."""

    @abstractmethod
    async def list_stuck(self, *, limit: int) -> list[Record]:
        """``IN_PROGRESS`` records whose owner's lease ran out: owners that died or stalled,
        the longest dead first."""

    @abstractmethod
    async def count_stuck(self, *, limit: int) -> int:
        """How many records ``list_stuck`` would list, counting no further than ``limit``:
        sampled for a gauge, it must stay cheap however many owners died."""

    async def sweep(self, *, batch_size: int = 1000, max_batches: int | None = None) -> int | None:
        """Delete expired records in batches until none are left (or ``max_batches`` ran);
        ``None`` when another sweeper is at work. A live execution is never deleted."""
        total = 0
        batches = 0
        while True:
            deleted = await self._sweep_batch(batch_size)
            if deleted is None:
                return None if batches == 0 else total
            total += deleted
            batches += 1
            if deleted < batch_size or batches == max_batches:
                return total
            # Small transactions with pauses between them: the sweeper never hogs the
            # database the request path needs.
            await asyncio.sleep(0)

    @abstractmethod
    async def _sweep_batch(self, batch_size: int) -> int | None:
        """Delete up to ``batch_size`` expired records that no live execution holds, in one
        transaction; how many went, or ``None`` when another sweeper holds the sweep."""

    @abstractmethod
    async def set_breaker_override(self, upstream: str, state: str | None, at: datetime) -> None:
        """Force ``upstream``'s breaker into ``state`` fleet-wide (``None``: no override)."""

    @abstractmethod
    async def breaker_overrides(self) -> dict[str, str]:
        """Every forced breaker state, by upstream."""

    @abstractmethod
    async def publish_invalidation(self, key: RecordKey) -> None:
        """Note, stamped with the database's clock, that ``key``'s cached answer must go."""

    @abstractmethod
    async def newest_invalidations(self, *, within: timedelta) -> tuple[int, set[int]]:
        """Where a starting reader begins: the newest invalidation's id (0 for none), and the
        ids of those noted ``within`` the last span of the database's clock."""

    @abstractmethod
    async def invalidations_after(
        self, seen: int, *, within: timedelta, keep: timedelta
    ) -> list[Invalidation]:
        """Invalidations after id ``seen`` and those noted ``within`` the last span, by id;
        in the same transaction, those older than ``keep`` are pruned."""
