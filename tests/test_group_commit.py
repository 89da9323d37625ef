"""Group commit on PostgreSQL: the reserves, and the finalizes, of one event-loop iteration
go out as one statement each, and every caller gets the answer it would have got alone.

Counted at the driver (asyncpg's query logger, ``StatementLog``): many reserves in one
iteration are one statement; the same key many times is one statement whose answers are
those of statements in a row (one reserves, the rest find it held); new and existing keys
mix; a stale fence loses only its own row; a key another transaction commits while the batch
waits on it is read back as held; a batch whose server process is terminated fails every
caller with ``StoreUnavailable`` and writes nothing. Through the gateway, a new key costs
exactly a reserve and a finalize: the execution fence adds nothing.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import asyncpg
import pytest
from asyncpg.transaction import Transaction

from idempotency_gateway.config import StoreConfig
from idempotency_gateway.database_url import asyncpg_dsn_of
from idempotency_gateway.errors import StoreUnavailable
from idempotency_gateway.storage import open_store
from idempotency_gateway.storage import postgres_sql as sql
from idempotency_gateway.storage.base import Claim, Reservation
from idempotency_gateway.storage.postgres import PostgresRecordStore
from idempotency_gateway.storage.records import Fence, RecordKey, Status, StoredResponse
from tests.support.gateway import StartGateway
from tests.support.keyed import send_keyed
from tests.support.statements import StatementLog
from tests.support.waiting import eventually

LEASE = 30.0
TTL = 3600.0
ANSWER = StoredResponse(status=201, headers=[("content-type", "text/plain")], body=b"done")


@pytest.fixture
def statements(monkeypatch: pytest.MonkeyPatch) -> StatementLog:
    return StatementLog(monkeypatch)


@pytest.fixture
async def store(postgres_url: str, statements: StatementLog) -> AsyncIterator[PostgresRecordStore]:
    opened = open_store(postgres_url, StoreConfig(group_commit=True))
    assert isinstance(opened, PostgresRecordStore)
    await opened.start()
    yield opened
    await opened.close()


def keys(name: str, count: int) -> list[RecordKey]:
    run = uuid.uuid4().hex[:12]
    return [RecordKey("scope-batch", "POST /v1/charges", f"{name}-{run}-{i}") for i in range(count)]


def claim(owner: str) -> Claim:
    return Claim("a" * 64, owner, LEASE, TTL)


async def hold_uncommitted(
    connection: asyncpg.Connection, key: RecordKey, *, owner: str
) -> Transaction:
    """A live record of ``owner`` for ``key``, inserted in a transaction left open: a batch
    that names the key waits on its row until the transaction ends."""
    transaction = connection.transaction()
    await transaction.start()
    await connection.execute(
        "INSERT INTO idempotency_records (scope, operation, idempotency_key, request_hash,"
        " status, owner_id, fencing_token, lease_expires_at, attempts, created_at,"
        " updated_at, expires_at) VALUES ($1, $2, $3, 'h', 'IN_PROGRESS', $4, 0,"
        " now() + interval '30 seconds', 1, now(), now(), now() + interval '1 hour')",
        *(key.tenant, key.operation, key.idempotency_key, owner),
    )
    return transaction


async def test_reserves_of_one_iteration_go_out_as_one_statement(
    store: PostgresRecordStore, statements: StatementLog
) -> None:
    wanted = keys("many", 20)
    owners = [f"owner-{i}" for i in range(len(wanted))]
    before = statements.of(sql.RESERVE_BATCH)
    got = await asyncio.gather(
        *(store.reserve(k, claim(o)) for k, o in zip(wanted, owners, strict=True))
    )
    assert statements.of(sql.RESERVE_BATCH) - before == 1
    assert all(reservation.reserved for reservation in got)
    assert [r.record.key for r in got] == wanted
    assert [r.record.owner_id for r in got] == owners
    assert len({r.record.fencing_token for r in got}) == len(wanted)
    assert len({r.now for r in got}) == 1  # one statement, one instant of the database's clock


async def test_the_same_key_twice_in_one_iteration_reserves_once(
    store: PostgresRecordStore, statements: StatementLog
) -> None:
    (key,) = keys("twice", 1)
    before = statements.of(sql.RESERVE_BATCH)
    first, second = await asyncio.gather(
        store.reserve(key, claim("first")), store.reserve(key, claim("second"))
    )
    # As two statements in a row: the first reserves, the second sees it hold the key; sent
    # as one statement, the second riding on the first's row.
    assert first.reserved
    assert not second.reserved
    assert second.record.owner_id == "first"
    assert second.record.fencing_token == first.record.fencing_token
    assert second.now == first.now
    assert statements.of(sql.RESERVE_BATCH) - before == 1


async def test_a_burst_of_duplicates_is_one_statement_with_one_owner_per_key(
    store: PostgresRecordStore, statements: StatementLog
) -> None:
    fresh, held = keys("burst", 1)[0], keys("burst-held", 1)[0]
    holder = await store.reserve(held, claim("holder"))
    burst = [(key, f"{name}-{i}") for i in range(30) for key, name in ((fresh, "f"), (held, "h"))]
    others = keys("beside", 3)
    before = statements.of(sql.RESERVE_BATCH)
    got = await asyncio.gather(
        *(store.reserve(key, claim(owner)) for key, owner in burst),
        *(store.reserve(key, claim("beside")) for key in others),
    )
    assert statements.of(sql.RESERVE_BATCH) - before == 1
    for_fresh = [r for r, (key, _) in zip(got, burst, strict=False) if key == fresh]
    for_held = [r for r, (key, _) in zip(got, burst, strict=False) if key == held]
    # One reserve won the fresh key (the first submitted); every other one finds its row.
    assert [r.reserved for r in for_fresh] == [True] + [False] * 29
    assert {(r.record.owner_id, r.record.fencing_token) for r in for_fresh} == {
        ("f-0", for_fresh[0].record.fencing_token)
    }
    # Nobody took the held key from its holder.
    assert not any(r.reserved for r in for_held)
    assert {(r.record.owner_id, r.record.fencing_token) for r in for_held} == {
        ("holder", holder.record.fencing_token)
    }
    assert all(r.reserved for r in got[len(burst) :])
    stored = await store.get(fresh)
    assert stored is not None
    assert stored.owner_id == "f-0"


async def test_new_and_existing_keys_mix_in_one_batch(
    store: PostgresRecordStore, statements: StatementLog
) -> None:
    held = keys("held", 3)
    fresh = keys("fresh", 3)
    holders = await asyncio.gather(*(store.reserve(k, claim("holder")) for k in held))
    before = statements.of(sql.RESERVE_BATCH)
    mixed = [k for pair in zip(held, fresh, strict=True) for k in pair]
    got: list[Reservation] = await asyncio.gather(*(store.reserve(k, claim("late")) for k in mixed))
    assert statements.of(sql.RESERVE_BATCH) - before == 1
    by_key = {r.record.key: r for r in got}
    for key, holder in zip(held, holders, strict=True):
        assert not by_key[key].reserved
        assert by_key[key].record.owner_id == "holder"
        assert by_key[key].record.fencing_token == holder.record.fencing_token
    for key in fresh:
        assert by_key[key].reserved
        assert by_key[key].record.owner_id == "late"


async def test_a_stale_fence_in_a_finalize_batch_loses_only_its_own_row(
    store: PostgresRecordStore, statements: StatementLog
) -> None:
    wanted = keys("fence", 4)
    got = await asyncio.gather(*(store.reserve(k, claim(f"o{i}")) for i, k in enumerate(wanted)))
    fences = [Fence(r.record.owner_id, r.record.fencing_token) for r in got]
    # The third names its own owner with a token it never held; the fourth another's owner.
    fences[2] = Fence(fences[2].owner_id, fences[2].fencing_token - 1)
    fences[3] = Fence(fences[0].owner_id, fences[3].fencing_token)
    before = statements.of(sql.FINALIZE_BATCH)
    written = await asyncio.gather(
        *(
            store.finalize(k, f, status=Status.SUCCEEDED, response=ANSWER, ttl=TTL)
            for k, f in zip(wanted, fences, strict=True)
        )
    )
    assert statements.of(sql.FINALIZE_BATCH) - before == 1
    assert written == [True, True, False, False]
    records = [await store.get(k) for k in wanted]
    assert [r.status if r else None for r in records] == [
        Status.SUCCEEDED,
        Status.SUCCEEDED,
        Status.IN_PROGRESS,
        Status.IN_PROGRESS,
    ]
    assert records[0] is not None
    assert records[0].response == ANSWER


async def test_a_failed_batch_fails_every_caller_and_writes_nothing(
    store: PostgresRecordStore, postgres_url: str
) -> None:
    wanted = keys("killed", 5)
    dsn = asyncpg_dsn_of(postgres_url)
    blocker = await asyncpg.connect(dsn)
    watcher = await asyncpg.connect(dsn)
    try:
        # An uncommitted row for the last key: the batch's insert waits on it, in flight.
        transaction = await hold_uncommitted(blocker, wanted[-1], owner="blocker")
        holder = await blocker.fetchval("SELECT pg_backend_pid()")
        reserves = [asyncio.create_task(store.reserve(k, claim("victim"))) for k in wanted]

        async def batch_pid() -> int | None:
            pid: int | None = await watcher.fetchval(
                "SELECT pid FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))", holder
            )
            return pid

        await watcher.execute("SELECT pg_terminate_backend($1)", await eventually(batch_pid))
        outcomes = await asyncio.gather(*reserves, return_exceptions=True)
        assert all(isinstance(outcome, StoreUnavailable) for outcome in outcomes), outcomes
        # Each caller has an error of its own, with the driver's in its chain.
        assert len({id(outcome) for outcome in outcomes}) == len(wanted)
        await transaction.rollback()
        left = await watcher.fetchval(
            "SELECT count(*) FROM idempotency_records WHERE idempotency_key = ANY($1)",
            [k.idempotency_key for k in wanted],
        )
        assert left == 0
    finally:
        await blocker.close()
        await watcher.close()
    # The store goes on: the next batch reserves them all.
    again = await asyncio.gather(*(store.reserve(k, claim("next")) for k in wanted))
    assert all(r.reserved for r in again)


async def test_a_key_committed_by_another_while_the_batch_waits_is_read_back_as_held(
    store: PostgresRecordStore, postgres_url: str, statements: StatementLog
) -> None:
    """The batch's insert waits on another transaction's uncommitted row for one of its keys;
    that transaction commits. The insert then skips the key, and the batch's own read of the
    held keys, bound to the statement's snapshot, cannot see the row: the follow-up read in a
    fresh snapshot must find it, so that caller learns who holds its key instead of failing."""
    wanted = keys("raced", 4)
    raced = wanted[-1]
    dsn = asyncpg_dsn_of(postgres_url)
    holder = await asyncpg.connect(dsn)
    watcher = await asyncpg.connect(dsn)
    try:
        transaction = await hold_uncommitted(holder, raced, owner="first-holder")
        holder_pid = await holder.fetchval("SELECT pg_backend_pid()")
        follow_ups = statements.of(sql.SELECT_BATCH_WITH_NOW)
        reserves = [asyncio.create_task(store.reserve(k, claim("batch"))) for k in wanted]

        async def batch_waits() -> bool:
            waiting: int = await watcher.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))",
                holder_pid,
            )
            return waiting == 1

        await eventually(batch_waits, message="the batch's insert waits on the uncommitted row")
        await transaction.commit()
        got = await asyncio.gather(*reserves)

        assert [r.reserved for r in got] == [True, True, True, False]
        assert got[-1].record.owner_id == "first-holder"
        assert got[-1].record.key == raced
        assert all(r.record.owner_id == "batch" for r in got[:-1])
        assert statements.of(sql.SELECT_BATCH_WITH_NOW) == follow_ups + 1
    finally:
        await holder.close()
        await watcher.close()


async def test_cancelled_callers_leave_the_rest_of_the_batch_answered(
    store: PostgresRecordStore,
) -> None:
    wanted = keys("cancel", 3)
    tasks = [asyncio.create_task(store.reserve(k, claim("c"))) for k in wanted]
    tasks[0].cancel()
    done = await asyncio.gather(*tasks, return_exceptions=True)
    assert isinstance(done[0], asyncio.CancelledError)
    assert all(isinstance(r, Reservation) and r.reserved for r in done[1:])
    # Cancelled before its batch went out: its reserve was never sent.
    assert await store.get(wanted[0]) is None


async def test_max_batch_bounds_a_statement(postgres_url: str, statements: StatementLog) -> None:
    store = open_store(postgres_url, StoreConfig(group_commit=True, group_commit_max_batch=4))
    try:
        before = statements.of(sql.RESERVE_BATCH)
        got = await asyncio.gather(*(store.reserve(k, claim("b")) for k in keys("bound", 10)))
        assert all(r.reserved for r in got)
        assert statements.of(sql.RESERVE_BATCH) - before == 3  # 4 + 4 + 2
    finally:
        await store.close()


@pytest.mark.parametrize("group_commit", [True, False], ids=["group-commit", "one-by-one"])
async def test_a_new_key_costs_a_reserve_and_a_finalize_through_the_gateway(
    start_gateway: StartGateway, postgres_url: str, statements: StatementLog, group_commit: bool
) -> None:
    """The execution fence trusts the lease its own reserve just granted: no renewal."""
    gateway = await start_gateway(postgres_url, keyed=True, store={"group_commit": group_commit})
    key = f"one-new-key-{uuid.uuid4().hex}"
    response = await send_keyed(gateway.client, key)
    assert response.status_code == 201
    expected = (
        [sql.RESERVE_BATCH, sql.FINALIZE_BATCH] if group_commit else [sql.RESERVE, sql.FINALIZE]
    )
    assert statements.naming(key) == expected
