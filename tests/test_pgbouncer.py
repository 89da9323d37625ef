"""The PostgreSQL store behind a real PgBouncer in transaction mode.

Three gateway processes share PgBouncer's four server connections: a storm on one key still
executes once and every client gets the same answer, and hundreds of new keys all succeed
with ``prepared_statements: false``. With named prepared statements on, the classic failure
is real, and shown deterministically. The sweeper's transaction-scoped lock holds through
PgBouncer: a sweeper stands aside while another transaction holds it, then sweeps.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import asyncpg
import httpx
import pytest

from idempotency_gateway.config import StoreConfig
from idempotency_gateway.errors import StoreUnavailable
from idempotency_gateway.storage import open_store
from idempotency_gateway.storage.base import Claim
from idempotency_gateway.storage.postgres_sql import SWEEP_LOCK_ID
from idempotency_gateway.storage.records import RecordKey
from tests.support import GatewayProcess, RecordingUpstream, write_config
from tests.support.clock import ManualClock
from tests.support.keyed import is_replay, keyed_gateway_config, send_keyed
from tests.support.pgbouncer import PgBouncer

pytestmark = pytest.mark.multiprocess

GATEWAYS = 3
STORM = 30
NEW_KEYS = 300
CONCURRENCY = 30
UNPREPARED = {"prepared_statements": False, "pool_size": 4}


@pytest.fixture(scope="module")
def pgbouncer(postgres_url: str) -> Iterator[PgBouncer]:
    with PgBouncer(postgres_url) as bouncer:
        yield bouncer


@pytest.fixture
async def gateway_clients(
    tmp_path: Path, pgbouncer: PgBouncer, redis_url: str, upstream: RecordingUpstream
) -> AsyncIterator[list[httpx.AsyncClient]]:
    """Clients of three gateway processes whose only way to PostgreSQL is PgBouncer."""
    config = keyed_gateway_config(upstream.url, store=UNPREPARED)
    config_path = write_config(tmp_path, config.model_dump(mode="json"))
    env = {"GATEWAY_DATABASE_URL": pgbouncer.url, "GATEWAY_REDIS_URL": redis_url}
    gateways = [
        GatewayProcess(config_path, env=env, log_dir=tmp_path, name=f"gw{index}")
        for index in range(GATEWAYS)
    ]
    async with contextlib.AsyncExitStack() as stack:
        try:
            await asyncio.gather(*(stack.enter_async_context(gw) for gw in gateways))
            clients = [
                await stack.enter_async_context(
                    httpx.AsyncClient(base_url=gw.url, timeout=30.0, trust_env=False)
                )
                for gw in gateways
            ]
            yield clients
        finally:
            for gw in gateways:
                log = gw.log_text()
                print(f"--- {gw.name} log tail ---\n{gw.log_tail()}")
                assert "prepared statement" not in log, f"{gw.name}: {log}"


async def test_same_key_storm_across_gateways_executes_once_and_replays(
    gateway_clients: list[httpx.AsyncClient],
    upstream: RecordingUpstream,
    unique: Callable[[str], str],
) -> None:
    key, gate = unique("storm"), unique("storm-gate")
    clients = itertools.cycle(gateway_clients)
    storm = [
        asyncio.create_task(
            send_keyed(next(clients), key, behavior=f"gate={gate}", prefer="wait=20")
        )
        for _ in range(STORM)
    ]
    await upstream.wait_arrived(gate)
    upstream.release(gate)
    responses = await asyncio.gather(*storm)

    assert upstream.count(key) == 1
    assert {(response.status_code, response.content) for response in responses} == {
        (201, responses[0].content)
    }
    assert sum(is_replay(response) for response in responses) == STORM - 1


async def test_new_keys_across_gateways_all_succeed_without_prepared_statements(
    gateway_clients: list[httpx.AsyncClient],
    upstream: RecordingUpstream,
    unique: Callable[[str], str],
) -> None:
    keys = [unique(f"new-{index}") for index in range(NEW_KEYS)]
    slots = asyncio.Semaphore(CONCURRENCY)

    async def send(index: int, key: str) -> httpx.Response:
        async with slots:
            return await send_keyed(gateway_clients[index % GATEWAYS], key)

    responses = await asyncio.gather(*(send(index, key) for index, key in enumerate(keys)))

    assert [response.status_code for response in responses] == [201] * NEW_KEYS
    assert not any(is_replay(response) for response in responses)
    assert [json.loads(response.content)["key"] for response in responses] == keys
    assert all(upstream.count(key) == 1 for key in keys)


# ------------------------------------------------------------------- prepared statements


async def connect(bouncer: PgBouncer) -> asyncpg.Connection:
    return await asyncpg.connect(bouncer.dsn, statement_cache_size=0)


def claim() -> Claim:
    return Claim(request_hash="1" * 64, owner_id=uuid.uuid4().hex, lease=30.0, ttl=3600.0)


@pytest.mark.parametrize("prepared", [True, False], ids=["prepared", "unprepared"])
async def test_named_prepared_statements_break_when_pgbouncer_moves_the_client(
    pgbouncer: PgBouncer, unique: Callable[[str], str], prepared: bool
) -> None:
    """The store's one client connection prepares the reserve on the server connection
    PgBouncer lends it; a second client then holds that server connection in a transaction
    (PgBouncer lends the most recently used one first), so the store's next reserve runs on
    another server connection, where a named statement does not exist."""
    store = open_store(pgbouncer.url, StoreConfig(pool_size=1, prepared_statements=prepared))
    holder = await connect(pgbouncer)
    scope = unique("moved")
    try:
        first = await store.reserve(RecordKey(scope, "POST /v1/charges", "first"), claim())
        async with holder.transaction():
            await holder.execute("SELECT 1")
            second_key = RecordKey(scope, "POST /v1/charges", "second")
            if prepared:
                with pytest.raises(StoreUnavailable) as raised:
                    await store.reserve(second_key, claim())
                assert isinstance(raised.value.__cause__, asyncpg.InvalidSQLStatementNameError)
            else:
                assert (await store.reserve(second_key, claim())).reserved
        assert first.reserved
    finally:
        await holder.execute("DELETE FROM idempotency_records WHERE scope = $1", scope)
        await holder.close()
        await store.close()


# ------------------------------------------------------------------------------- sweeper


async def test_sweeper_stands_aside_while_another_transaction_holds_the_lock(
    pgbouncer: PgBouncer, unique: Callable[[str], str]
) -> None:
    # A moment long before any other test's records: only this test's row can be expired.
    clock = ManualClock()
    clock.now = datetime(2001, 1, 1, tzinfo=UTC)
    store = open_store(pgbouncer.url, StoreConfig(prepared_statements=False), clock=clock.utc)
    holder = await connect(pgbouncer)
    key = RecordKey(unique("sweep"), "POST /v1/charges", "expired")
    try:
        await store.sweep()  # leftovers of an interrupted earlier run
        await store.reserve(key, Claim("1" * 64, uuid.uuid4().hex, lease=1.0, ttl=1.0))
        clock.now += timedelta(seconds=2)

        async with holder.transaction():
            assert await holder.fetchval("SELECT pg_try_advisory_xact_lock($1)", SWEEP_LOCK_ID)
            assert await store.sweep() is None
            assert await store.get(key) is not None
        # The COMMIT released the lock on the server connection that held it.
        assert await store.sweep() == 1
        assert await store.get(key) is None
    finally:
        await holder.close()
        await store.close()
