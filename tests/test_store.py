"""The real ``RecordStore`` on PostgreSQL and SQLite keeps every promise the machine relies on.

One atomic reserve per key even under 50 concurrent callers, compare-and-set takeovers that fence
off the old owner, owner-only finalize and lease renewal, byte-exact (compressed) stored answers,
batched sweeping of expired rows only, ``StoreUnavailable`` instead of raw driver errors, and an
Alembic migration that builds the schema once and is a no-op the second time.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sqlite3
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import asyncpg
import pytest
from alembic.script import ScriptDirectory
from sqlalchemy import inspect, select

from idempotency_gateway.config import StoreConfig
from idempotency_gateway.database_url import asyncpg_dsn_of
from idempotency_gateway.errors import StoreUnavailable
from idempotency_gateway.migrate import alembic_config, upgrade_to_head
from idempotency_gateway.storage import open_store
from idempotency_gateway.storage.base import Claim, RecordStore, Removal, Reservation
from idempotency_gateway.storage.postgres_sql import SWEEP_LOCK_ID
from idempotency_gateway.storage.records import Fence, Record, RecordKey, Status, StoredResponse
from idempotency_gateway.storage.schema import records
from tests.support import free_port
from tests.support.clock import ManualClock
from tests.support.database import on_database

LEASE = 30.0
TTL = 3600.0
FIRST_HASH = "1" * 64
OTHER_HASH = "2" * 64

# About 200 KiB of repetitive JSON: what a list endpoint's answer looks like, and compressible.
_CHARGE = b'{"object":"charge","amount":1250,"currency":"EUR","paid":true,"refunded":false}'
LARGE_JSON_BODY = b"[" + b",".join([_CHARGE] * (200 * 1024 // len(_CHARGE))) + b"]"


def new_owner() -> str:
    return uuid.uuid4().hex


def after(clock: ManualClock, seconds: float) -> datetime:
    return clock.now + timedelta(seconds=seconds)


def claim_for(owner_id: str, *, request_hash: str = FIRST_HASH, ttl: float = TTL) -> Claim:
    return Claim(request_hash=request_hash, owner_id=owner_id, lease=LEASE, ttl=ttl)


async def reserve(
    store: RecordStore, key: RecordKey, owner_id: str, *, request_hash: str = FIRST_HASH
) -> Reservation:
    return await store.reserve(key, claim_for(owner_id, request_hash=request_hash))


async def take_over(
    store: RecordStore, seen: Record, owner_id: str, *, request_hash: str = FIRST_HASH
) -> Record | None:
    return await store.take_over(seen, claim_for(owner_id, request_hash=request_hash))


def fence_of(record: Record) -> Fence:
    return Fence(record.owner_id, record.fencing_token)


@pytest.fixture
def make_key(unique: Callable[[str], str]) -> Callable[[str], RecordKey]:
    scope = unique("scope")
    return lambda name: RecordKey(scope, "POST /v1/charges", unique(name))


@pytest.fixture
def key(make_key: Callable[[str], RecordKey]) -> RecordKey:
    return make_key("key")


async def stored_body_columns(database_url: str, key: RecordKey) -> tuple[bytes, bool]:
    """The body as it sits in the table, bypassing the store's decoding."""
    statement = select(records.c.response_body, records.c.body_compressed).where(
        records.c.scope == key.tenant,
        records.c.operation == key.operation,
        records.c.idempotency_key == key.idempotency_key,
    )
    row = await on_database(database_url, lambda connection: connection.execute(statement).one())
    return bytes(row.response_body), bool(row.body_compressed)


# ------------------------------------------------------------------------------- reserve


async def test_reserve_on_absent_key_inserts_in_progress_record(
    store: RecordStore, clock: ManualClock, key: RecordKey
) -> None:
    owner = new_owner()

    reservation = await reserve(store, key, owner)

    assert reservation.reserved
    record = reservation.record
    assert record.key == key
    assert record.request_hash == FIRST_HASH
    assert record.status is Status.IN_PROGRESS
    assert record.owner_id == owner
    assert record.fencing_token >= 1
    assert record.attempts == 1
    assert record.response is None
    assert record.created_at == clock.now
    assert record.updated_at == clock.now
    assert record.lease_expires_at == after(clock, LEASE)
    assert record.expires_at == after(clock, TTL)
    assert await store.get(key) == record


async def test_second_reserve_returns_first_owners_record_untouched(
    store: RecordStore, clock: ManualClock, key: RecordKey
) -> None:
    first = (await reserve(store, key, new_owner())).record
    clock.advance(5)

    second = await reserve(store, key, new_owner(), request_hash=OTHER_HASH)

    assert not second.reserved
    assert second.record == first
    assert await store.get(key) == first


async def test_concurrent_reserves_elect_exactly_one_owner(
    store: RecordStore, key: RecordKey
) -> None:
    owners = [new_owner() for _ in range(50)]

    reservations = await asyncio.gather(*(reserve(store, key, owner) for owner in owners))

    winners = [reservation.record.owner_id for reservation in reservations if reservation.reserved]
    assert len(winners) == 1
    assert {reservation.record.owner_id for reservation in reservations} == set(winners)
    assert len({reservation.record.fencing_token for reservation in reservations}) == 1
    stored = await store.get(key)
    assert stored is not None
    assert stored.owner_id == winners[0]
    assert stored.attempts == 1


# ----------------------------------------------------------------------------- take over


async def test_take_over_after_lease_fences_off_the_old_owner(
    store: RecordStore, clock: ManualClock, key: RecordKey
) -> None:
    stale = (await reserve(store, key, new_owner())).record
    clock.advance(LEASE + 1)
    successor = new_owner()

    taken = await take_over(store, stale, successor)

    assert taken is not None
    assert taken.status is Status.IN_PROGRESS
    assert taken.owner_id == successor
    assert taken.fencing_token > stale.fencing_token
    assert taken.attempts == 2
    assert taken.lease_expires_at == after(clock, LEASE)
    assert taken.updated_at == clock.now
    # Same life: the TTL still counts from the first reservation.
    assert taken.created_at == stale.created_at
    assert taken.expires_at == stale.expires_at

    # A second claimant that read the same stale row loses the compare-and-set.
    assert await take_over(store, stale, new_owner()) is None

    old_fence = fence_of(stale)
    answer = StoredResponse(status=201, headers=[("content-type", "text/plain")], body=b"late")
    assert not await store.finalize(
        key, old_fence, status=Status.SUCCEEDED, response=answer, ttl=TTL
    )
    assert not await store.renew_lease(key, old_fence, lease=LEASE)
    assert await store.get(key) == taken


async def test_take_over_of_retryable_failure_bumps_token_and_clears_answer(
    store: RecordStore, clock: ManualClock, key: RecordKey
) -> None:
    first = (await reserve(store, key, new_owner())).record
    busy = StoredResponse(status=503, headers=[("retry-after", "1")], body=b"busy")
    assert await store.finalize(
        key, fence_of(first), status=Status.FAILED_RETRYABLE, response=busy, ttl=TTL
    )
    failed = await store.get(key)
    assert failed is not None
    clock.advance(1)

    retried = await take_over(store, failed, new_owner())

    assert retried is not None
    assert retried.status is Status.IN_PROGRESS
    assert retried.fencing_token > first.fencing_token
    assert retried.attempts == 2
    assert retried.response is None
    assert retried.expires_at == first.expires_at


async def test_take_over_of_expired_record_starts_a_new_life(
    store: RecordStore, clock: ManualClock, key: RecordKey
) -> None:
    first = (await reserve(store, key, new_owner())).record
    clock.advance(LEASE + 1)
    second = await take_over(store, first, new_owner())
    assert second is not None
    answer = StoredResponse(status=201, headers=[("content-type", "text/plain")], body=b"done")
    assert await store.finalize(
        key, fence_of(second), status=Status.SUCCEEDED, response=answer, ttl=TTL
    )
    finished = await store.get(key)
    assert finished is not None
    assert finished.fencing_token == second.fencing_token
    clock.advance(TTL)
    assert finished.is_expired(clock.now)
    newcomer = new_owner()

    reborn = await take_over(store, finished, newcomer, request_hash=OTHER_HASH)

    assert reborn is not None
    assert reborn.status is Status.IN_PROGRESS
    assert reborn.owner_id == newcomer
    assert reborn.request_hash == OTHER_HASH
    # A new life, yet a larger token: the old owner's late write is still refused.
    assert reborn.fencing_token > finished.fencing_token
    assert reborn.attempts == 1
    assert reborn.response is None
    assert reborn.created_at == clock.now
    assert reborn.expires_at == after(clock, TTL)
    assert reborn.lease_expires_at == after(clock, LEASE)
    assert await store.get(key) == reborn


async def live_past_its_ttl(store: RecordStore, clock: ManualClock, key: RecordKey) -> Record:
    """An execution whose TTL has passed while the owner still holds a renewed lease."""
    short = Claim(request_hash=FIRST_HASH, owner_id=new_owner(), lease=LEASE, ttl=LEASE)
    live = (await store.reserve(key, short)).record
    clock.advance(LEASE - 1)
    assert await store.renew_lease(key, fence_of(live), lease=LEASE)
    clock.advance(2)  # past the TTL, inside the renewed lease
    return live


async def test_take_over_never_steals_a_live_execution_past_its_ttl(
    store: RecordStore, clock: ManualClock, key: RecordKey
) -> None:
    await live_past_its_ttl(store, clock, key)
    renewed = await store.get(key)
    assert renewed is not None
    assert not renewed.is_expired(clock.now)

    # Even a claimant that judged the row expired (a stale read, a wrong clock) loses.
    assert await take_over(store, renewed, new_owner()) is None
    assert await store.get(key) == renewed


async def test_finalize_after_the_ttl_keeps_the_answer_a_full_ttl(
    store: RecordStore, clock: ManualClock, key: RecordKey
) -> None:
    live = await live_past_its_ttl(store, clock, key)
    answer = StoredResponse(status=201, headers=[], body=b"slow but done")

    assert await store.finalize(
        key, fence_of(live), status=Status.SUCCEEDED, response=answer, ttl=LEASE
    )

    finished = await store.get(key)
    assert finished is not None
    assert finished.expires_at == after(clock, LEASE)
    assert not finished.is_expired(clock.now)


# ------------------------------------------------------------------------------ finalize


@pytest.mark.parametrize(
    ("body", "stored_compressed"),
    [
        pytest.param(b"", False, id="empty"),
        pytest.param(b'{"id":"ch_1"}', False, id="small"),
        pytest.param(os.urandom(8 * 1024), False, id="incompressible-binary"),
        pytest.param(LARGE_JSON_BODY, True, id="large-compressible-json"),
    ],
)
async def test_finalize_stores_status_headers_and_body_byte_exact(
    store: RecordStore, database_url: str, key: RecordKey, body: bytes, stored_compressed: bool
) -> None:
    record = (await reserve(store, key, new_owner())).record
    headers = [
        ("content-type", "application/json"),
        ("set-cookie", "a=1"),
        ("set-cookie", "b=2"),
        ("x-request-id", "req-1"),
        # obs-text as the capture keeps it (latin-1 decoded): every byte value back as it was.
        ("x-customer-name", bytes(range(0x80, 0x100)).decode("latin-1") + ' "\\ \t'),
    ]
    answer = StoredResponse(status=201, headers=headers, body=body)

    assert await store.finalize(
        key, fence_of(record), status=Status.SUCCEEDED, response=answer, ttl=TTL
    )

    finished = await store.get(key)
    assert finished is not None
    assert finished.status is Status.SUCCEEDED
    assert finished.response == answer
    assert finished.fencing_token == record.fencing_token
    raw_body, compressed = await stored_body_columns(database_url, key)
    assert compressed is stored_compressed
    if stored_compressed:
        assert len(raw_body) < len(body) // 10
    else:
        assert raw_body == body


async def test_finalize_round_trips_body_omitted(store: RecordStore, key: RecordKey) -> None:
    record = (await reserve(store, key, new_owner())).record
    answer = StoredResponse(
        status=200, headers=[("content-type", "text/event-stream")], body=b"", body_omitted=True
    )

    assert await store.finalize(
        key, fence_of(record), status=Status.SUCCEEDED, response=answer, ttl=TTL
    )

    finished = await store.get(key)
    assert finished is not None
    assert finished.response is not None
    assert finished.response.body_omitted is True
    assert finished.response == answer


async def test_finalize_without_response_keeps_none(store: RecordStore, key: RecordKey) -> None:
    record = (await reserve(store, key, new_owner())).record

    assert await store.finalize(
        key, fence_of(record), status=Status.FAILED_RETRYABLE, response=None, ttl=TTL
    )

    finished = await store.get(key)
    assert finished is not None
    assert finished.status is Status.FAILED_RETRYABLE
    assert finished.response is None


async def test_finalize_twice_is_refused_the_second_time(
    store: RecordStore, key: RecordKey
) -> None:
    record = (await reserve(store, key, new_owner())).record
    first = StoredResponse(status=201, headers=[], body=b"first")
    assert await store.finalize(
        key, fence_of(record), status=Status.SUCCEEDED, response=first, ttl=TTL
    )

    second = StoredResponse(status=500, headers=[], body=b"second")
    assert not await store.finalize(
        key, fence_of(record), status=Status.FAILED_FINAL, response=second, ttl=TTL
    )

    finished = await store.get(key)
    assert finished is not None
    assert finished.status is Status.SUCCEEDED
    assert finished.response == first


# --------------------------------------------------------------------------- renew lease


async def test_renew_lease_extends_the_owners_lease_only(
    store: RecordStore, clock: ManualClock, key: RecordKey
) -> None:
    record = (await reserve(store, key, new_owner())).record
    clock.advance(10)

    stranger = Fence(new_owner(), record.fencing_token)
    wrong_token = Fence(record.owner_id, record.fencing_token + 1)
    assert not await store.renew_lease(key, stranger, lease=LEASE)
    assert not await store.renew_lease(key, wrong_token, lease=LEASE)
    assert await store.get(key) == record

    assert await store.renew_lease(key, fence_of(record), lease=LEASE)

    renewed = await store.get(key)
    assert renewed is not None
    assert renewed.lease_expires_at == after(clock, LEASE)
    assert renewed.updated_at == clock.now
    assert renewed.owner_id == record.owner_id
    assert renewed.fencing_token == record.fencing_token
    assert renewed.expires_at == record.expires_at


async def test_renew_lease_after_finalize_changes_nothing(
    store: RecordStore, clock: ManualClock, key: RecordKey
) -> None:
    record = (await reserve(store, key, new_owner())).record
    answer = StoredResponse(status=200, headers=[], body=b"ok")
    assert await store.finalize(
        key, fence_of(record), status=Status.SUCCEEDED, response=answer, ttl=TTL
    )
    finished = await store.get(key)
    clock.advance(10)

    assert not await store.renew_lease(key, fence_of(record), lease=LEASE)
    assert await store.get(key) == finished


# ------------------------------------------------------------------------ delete and get


async def test_delete_removes_the_record(
    store: RecordStore, clock: ManualClock, key: RecordKey
) -> None:
    await reserve(store, key, new_owner())
    clock.advance(LEASE)  # its owner is gone

    assert await store.delete(key) is Removal.DONE

    assert await store.get(key) is None
    assert await store.delete(key) is Removal.ABSENT
    # The key is free again.
    assert (await reserve(store, key, new_owner())).reserved


@pytest.mark.parametrize("removal", ["delete", "expire"])
async def test_a_live_execution_is_neither_deleted_nor_expired(
    store: RecordStore, clock: ManualClock, key: RecordKey, removal: str
) -> None:
    """Removed under its owner, whose lease lets it send without asking again, the record
    would let a duplicate execute beside it."""
    record = (await reserve(store, key, new_owner())).record
    remove = store.delete if removal == "delete" else store.expire

    assert await remove(key) is Removal.IN_FLIGHT
    assert await store.get(key) == record

    clock.advance(LEASE)  # the lease ran out: the owner is presumed dead
    assert await remove(key) is Removal.DONE
    await store.delete(key)


async def test_get_of_absent_key_is_none(store: RecordStore, key: RecordKey) -> None:
    assert await store.get(key) is None


# ------------------------------------------------------------------------ admin paths


async def test_admin_paths_read_and_change_what_the_hot_path_wrote(
    store: RecordStore, clock: ManualClock, key: RecordKey
) -> None:
    """The admin paths run through SQLAlchemy, the hot path on the driver directly: both
    must agree on how times are stored, or a stuck owner would go unseen."""
    clock.now = datetime(2001, 1, 1, tzinfo=UTC)
    record = (await reserve(store, key, new_owner())).record

    def ours(records: list[Record]) -> list[Record]:
        return [stuck for stuck in records if stuck.key == key]

    clock.advance(LEASE - 1)
    assert ours(await store.list_stuck(limit=1000)) == []
    clock.advance(1)  # lease_expires_at <= now: the owner is presumed dead
    assert ours(await store.list_stuck(limit=1000)) == [record]

    assert await store.expire(key) is Removal.DONE
    expired = await store.get(key)
    assert expired is not None
    assert (expired.expires_at, expired.is_expired(clock.now)) == (clock.now, True)
    await store.delete(key)


# --------------------------------------------------------------------------------- sweep


async def drain_expired_at(store: RecordStore, clock: ManualClock, moment: datetime) -> None:
    """Remove leftovers of an interrupted earlier run that would expire by ``moment``."""
    now = clock.now
    clock.now = moment
    await store.sweep()
    clock.now = now


async def test_sweep_deletes_only_expired_records_in_batches(
    store: RecordStore, clock: ManualClock, make_key: Callable[[str], RecordKey]
) -> None:
    # A moment long before any other test's records (the manual clock starts in 2026 and real
    # time is later), so in the shared PostgreSQL database only this test's rows can expire.
    clock.now = datetime(2001, 1, 1, tzinfo=UTC)
    short_ttl = LEASE
    await drain_expired_at(store, clock, after(clock, short_ttl))
    expired = [make_key(f"expired-{index}") for index in range(5)]
    live = [make_key(f"live-{index}") for index in range(2)]
    for record_key in expired:
        await store.reserve(record_key, claim_for(new_owner(), ttl=short_ttl))
    for record_key in live:
        await store.reserve(record_key, claim_for(new_owner()))
    clock.advance(short_ttl)  # expires_at <= now counts as expired

    batches = [await store.sweep(batch_size=2, max_batches=1) for _ in range(4)]
    assert batches == [2, 2, 1, 0]
    for record_key in expired:
        assert await store.get(record_key) is None
    for record_key in live:
        assert await store.get(record_key) is not None
        await store.delete(record_key)


async def test_sweep_without_a_batch_limit_runs_every_batch(
    store: RecordStore, clock: ManualClock, make_key: Callable[[str], RecordKey]
) -> None:
    clock.now = datetime(2001, 1, 1, tzinfo=UTC)
    await drain_expired_at(store, clock, after(clock, LEASE))
    expired = [make_key(f"all-expired-{index}") for index in range(5)]
    for record_key in expired:
        await store.reserve(record_key, claim_for(new_owner(), ttl=LEASE))
    clock.advance(LEASE)

    assert await store.sweep(batch_size=2) == 5
    for record_key in expired:
        assert await store.get(record_key) is None


async def test_sweep_never_deletes_a_live_execution_past_its_ttl(
    store: RecordStore, clock: ManualClock, key: RecordKey
) -> None:
    clock.now = datetime(2001, 1, 1, tzinfo=UTC)
    await drain_expired_at(store, clock, after(clock, LEASE + 1))
    await live_past_its_ttl(store, clock, key)

    assert await store.sweep() == 0
    assert await store.get(key) is not None

    clock.advance(LEASE)  # the owner stopped renewing: now it is only an expired row
    assert await store.sweep() == 1
    assert await store.get(key) is None


async def test_a_second_postgres_sweeper_stands_aside_while_one_holds_the_lock(
    postgres_url: str, clock: ManualClock
) -> None:
    holder = await asyncpg.connect(asyncpg_dsn_of(postgres_url))
    other = open_store(postgres_url, StoreConfig(), clock=clock.utc)
    try:
        await holder.execute("SELECT pg_advisory_lock($1)", SWEEP_LOCK_ID)
        assert await other.sweep() is None
        await holder.execute("SELECT pg_advisory_unlock($1)", SWEEP_LOCK_ID)
        assert await other.sweep() is not None
    finally:
        await holder.close()
        await other.close()


# ---------------------------------------------------------------------- store unavailable

StoreCall = Callable[[RecordStore, RecordKey], Awaitable[object]]

_FENCE = Fence("0" * 32, 1)
STORE_CALLS: list[StoreCall] = [
    lambda store, key: store.reserve(key, claim_for(new_owner())),
    lambda store, key: store.get(key),
    lambda store, key: store.finalize(
        key, _FENCE, status=Status.SUCCEEDED, response=StoredResponse(200, [], b"ok"), ttl=TTL
    ),
    lambda store, key: store.renew_lease(key, _FENCE, lease=LEASE),
    lambda store, key: store.delete(key),
    lambda store, key: store.sweep(),
    lambda store, key: store.ping(),
]
STORE_CALL_IDS = ["reserve", "get", "finalize", "renew_lease", "delete", "sweep", "ping"]


@pytest.fixture
async def closed_port_store() -> AsyncIterator[RecordStore]:
    url = f"postgresql+asyncpg://postgres@127.0.0.1:{free_port()}/x"
    unreachable = open_store(url, StoreConfig(connect_timeout=0.5))
    yield unreachable
    await unreachable.close()


@pytest.fixture
async def silent_server_store() -> AsyncIterator[RecordStore]:
    """A database address that accepts connections and then never says a word."""
    accepted: list[asyncio.StreamWriter] = []

    async def stay_silent(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer)

    server = await asyncio.start_server(stay_silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    url = f"postgresql+asyncpg://postgres@127.0.0.1:{port}/x"
    silent = open_store(url, StoreConfig(connect_timeout=0.5))
    yield silent
    await silent.close()
    for writer in accepted:
        writer.close()
    server.close()
    await server.wait_closed()


@pytest.mark.parametrize("call", STORE_CALLS, ids=STORE_CALL_IDS)
async def test_refused_connection_raises_store_unavailable(
    closed_port_store: RecordStore, key: RecordKey, call: StoreCall
) -> None:
    with pytest.raises(StoreUnavailable) as raised:
        await call(closed_port_store, key)
    assert raised.value.__cause__ is not None


@pytest.mark.parametrize("call", STORE_CALLS[:3], ids=STORE_CALL_IDS[:3])
async def test_silent_database_raises_store_unavailable_after_connect_timeout(
    silent_server_store: RecordStore, key: RecordKey, call: StoreCall
) -> None:
    loop = asyncio.get_running_loop()
    started = loop.time()

    with pytest.raises(StoreUnavailable):
        await call(silent_server_store, key)

    # Bounded by connect_timeout (0.5 s), not by a driver default of a minute.
    assert loop.time() - started < 5.0


# ---------------------------------------------------------------------------- migrations


def sqlite_schema(path: Path) -> list[tuple[str, str, str | None]]:
    with contextlib.closing(sqlite3.connect(path)) as connection:
        return connection.execute(
            "SELECT type, name, sql FROM sqlite_master ORDER BY type, name"
        ).fetchall()


def sqlite_alembic_versions(path: Path) -> list[str]:
    with contextlib.closing(sqlite3.connect(path)) as connection:
        return [row[0] for row in connection.execute("SELECT version_num FROM alembic_version")]


def test_upgrade_to_head_builds_the_schema_once(tmp_path: Path) -> None:
    path = tmp_path / "fresh.db"
    url = f"sqlite:///{path}"

    upgrade_to_head(url)

    schema = sqlite_schema(path)
    names = {(kind, name) for kind, name, _sql in schema}
    assert ("table", "idempotency_records") in names
    assert ("index", "ix_idempotency_records_expires_at") in names
    assert ("index", "ix_idempotency_records_stale_in_progress") in names
    partial_index_sql = next(
        sql for _kind, name, sql in schema if name == "ix_idempotency_records_stale_in_progress"
    )
    assert partial_index_sql is not None
    assert "WHERE status = 'IN_PROGRESS'" in partial_index_sql
    with contextlib.closing(sqlite3.connect(path)) as connection:
        table_info = connection.execute("PRAGMA table_info(idempotency_records)").fetchall()
    assert {row[1] for row in table_info} == {column.name for column in records.columns}
    primary_key = [row[1] for row in sorted(table_info, key=lambda row: row[5]) if row[5]]
    assert primary_key == ["scope", "operation", "idempotency_key"]
    head = ScriptDirectory.from_config(alembic_config(url)).get_current_head()
    assert sqlite_alembic_versions(path) == [head]

    upgrade_to_head(url)

    assert sqlite_schema(path) == schema
    assert sqlite_alembic_versions(path) == [head]


async def test_migrated_schema_has_the_primary_key_and_indexes(database_url: str) -> None:
    def describe(connection: object) -> tuple[list[str], set[str]]:
        inspector = inspect(connection)
        primary_key = inspector.get_pk_constraint("idempotency_records")["constrained_columns"]
        indexes = {index["name"] for index in inspector.get_indexes("idempotency_records")}
        return primary_key, {name for name in indexes if name is not None}

    primary_key, indexes = await on_database(database_url, describe)

    assert primary_key == ["scope", "operation", "idempotency_key"]
    assert {
        "ix_idempotency_records_expires_at",
        "ix_idempotency_records_stale_in_progress",
    } <= indexes
