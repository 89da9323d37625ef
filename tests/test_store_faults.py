"""Short store faults neither lose an executed answer nor burn a key that never ran.

PostgreSQL is cut off from a gateway with ``TcpProxy`` (every connection reset, new ones
refused) for a few seconds, at the moments that used to cost keys:

- during the finalize: the owner keeps trying until its lease runs out, and its client gets
  the whole answer once it is recorded, never a head and a closed connection;
- past the lease: the client gets a whole problem instead of the unrecorded answer;
- while a reserve waits on a row lock: the client gets a 503, the reserve commits later, and
  the owner releases that orphan once the store answers, so the key runs exactly once;
- while a finalize waits on a row lock: it commits although its answer is lost; the retry
  matches no row, reads the record back and counts it as written, not as fenced.

A row lock held by the test on the record is what makes a statement commit after the gateway
stopped waiting for it: the statement's server process finishes once the lock goes, with
nobody left to hear the answer.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest
from sqlalchemy.engine import make_url

from idempotency_gateway.config import GatewayConfig
from idempotency_gateway.database_url import asyncpg_dsn_of
from idempotency_gateway.storage.records import RecordKey, Status
from idempotency_gateway.telemetry.metrics import FENCED_WRITES
from tests.support import GatewayProcess, RecordingUpstream, eventually, write_config
from tests.support.gateway import GatewayLauncher, RunningGateway, route
from tests.support.keyed import (
    assert_replays,
    is_replay,
    keyed_gateway_config,
    record_key,
    send_keyed,
)
from tests.support.pgbouncer import PgBouncer
from tests.support.problems import problem_slug
from tests.support.tcp_proxy import TcpProxy

pytestmark = pytest.mark.slow

# Long enough that no lease runs out and no renewal is due while a test holds a fault open.
LONG_LEASE = "30s"
# The outage the finalize must outlast: longer than the old retry budget (about 0.6 s).
OUTAGE = 3.0
# A gateway process starts slowly on a busy machine; waiting for it is no timed assertion.
STARTUP = 60.0

_KEY_MATCHES = "scope = $1 AND operation = $2 AND idempotency_key = $3"


def _key_args(key: RecordKey) -> tuple[str, str, str]:
    return key.tenant, key.operation, key.idempotency_key


@pytest.fixture
async def database(postgres_url: str) -> AsyncIterator[TcpProxy]:
    """PostgreSQL as the gateways under test reach it: through a link the test can cut."""
    target = make_url(postgres_url)
    async with TcpProxy(target.host or "127.0.0.1", target.port or 5432) as proxy:
        yield proxy


@pytest.fixture
async def direct(postgres_url: str) -> AsyncIterator[asyncpg.Connection]:
    """The test's own connection to the database, around the proxy."""
    connection = await asyncpg.connect(asyncpg_dsn_of(postgres_url))
    yield connection
    await connection.close()


async def _gateway_behind(
    launcher: GatewayLauncher,
    upstream: RecordingUpstream,
    database: TcpProxy,
    store_url: str,
    *,
    lease: str,
    **settings: Any,
) -> RunningGateway:
    """A gateway whose store is ``store_url`` reached through ``database``."""
    config = _config(upstream, lease=lease, **settings)
    return await launcher.start(config, database_url=database.rewrite_url(store_url))


async def _row(connection: asyncpg.Connection, key: RecordKey) -> asyncpg.Record | None:
    return await connection.fetchrow(
        f"SELECT status, owner_id FROM idempotency_records WHERE {_KEY_MATCHES}",
        *_key_args(key),
    )


async def _row_with_status(
    connection: asyncpg.Connection, key: RecordKey, status: Status
) -> asyncpg.Record | None:
    row = await _row(connection, key)
    return row if row is not None and row["status"] == status.value else None


@contextlib.asynccontextmanager
async def _watching(postgres_url: str) -> AsyncIterator[asyncpg.Connection]:
    """A second connection of the test's, to look at the one holding a lock."""
    connection = await asyncpg.connect(asyncpg_dsn_of(postgres_url))
    try:
        yield connection
    finally:
        await connection.close()


async def _blocked_by(watcher: asyncpg.Connection, holder_pid: int) -> bool:
    """Whether some statement waits on a lock the server process ``holder_pid`` holds."""
    waiting = await watcher.fetchval(
        "SELECT count(*) FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))",
        holder_pid,
    )
    return bool(waiting)


async def _executing(
    gateway: RunningGateway, upstream: RecordingUpstream, key: str
) -> asyncio.Task[httpx.Response]:
    """A keyed request whose execution waits at the upstream until ``release("run")``."""
    answer = asyncio.create_task(send_keyed(gateway.client, key, behavior="gate=run"))
    await upstream.wait_arrived("run")
    return answer


async def _executing_cut_off(
    launcher: GatewayLauncher,
    upstream: RecordingUpstream,
    database: TcpProxy,
    postgres_url: str,
    key: str,
) -> asyncio.Task[httpx.Response]:
    """A keyed request executing on a gateway with a 1 s lease, whose store link is cut
    while the upstream holds the request."""
    gateway = await _gateway_behind(launcher, upstream, database, postgres_url, lease="1s")
    answer = await _executing(gateway, upstream, key)
    await database.cut()
    return answer


def _config(upstream: RecordingUpstream, *, lease: str, **settings: Any) -> GatewayConfig:
    return keyed_gateway_config(
        upstream.url, routes=[route("/", key="required", lease=lease)], **settings
    )


@pytest.mark.parametrize("through", ["postgresql", "pgbouncer"])
async def test_an_executed_answer_survives_a_store_outage_shorter_than_the_lease(
    through: str,
    postgres_url: str,
    upstream: RecordingUpstream,
    direct: asyncpg.Connection,
    unique: Callable[[str], str],
) -> None:
    key = unique("outage")
    loop = asyncio.get_running_loop()
    async with contextlib.AsyncExitStack() as stack, GatewayLauncher() as launcher:
        if through == "pgbouncer":
            # PgBouncer (transaction mode) is what goes away, PostgreSQL stays up.
            bouncer = stack.enter_context(PgBouncer(postgres_url))
            store_url, settings = bouncer.url, {"store": {"prepared_statements": False}}
        else:
            store_url, settings = postgres_url, {}
        target = make_url(store_url)
        database = await stack.enter_async_context(
            TcpProxy(target.host or "127.0.0.1", target.port or 5432)
        )
        gateway = await _gateway_behind(
            launcher, upstream, database, store_url, lease=LONG_LEASE, **settings
        )
        answer = await _executing(gateway, upstream, key)
        await database.cut()
        cut_at = loop.time()
        upstream.release("run")
        # The owner keeps trying to record the outcome all through the outage.
        await eventually(
            lambda: database.rejected >= 5 and loop.time() - cut_at >= OUTAGE,
            timeout=OUTAGE + 10,
        )
        assert not answer.done(), "the client got an answer before its outcome was recorded"
        await database.restore()
        response = await answer

        assert response.status_code == 201, response.text
        assert response.json()["key"] == key
        assert upstream.count(key) == 1
        row = await _row(direct, record_key(key))
        assert row is not None
        assert row["status"] == Status.SUCCEEDED.value
        await assert_replays(gateway.client, key, response, upstream)


async def test_an_answer_the_store_cannot_record_within_the_lease_is_replaced_whole(
    postgres_url: str,
    upstream: RecordingUpstream,
    database: TcpProxy,
    unique: Callable[[str], str],
) -> None:
    key = unique("past-lease")
    async with GatewayLauncher() as launcher:
        answer = await _executing_cut_off(launcher, upstream, database, postgres_url, key)
        upstream.release("run")
        # Never the upstream's 201 head followed by a closed connection: a whole problem.
        response = await answer
        await database.restore()

    assert response.status_code == 503, response.text
    assert problem_slug(response.content) == "store-unavailable"
    assert upstream.count(key) == 1


async def test_a_reserve_that_committed_after_its_request_failed_is_released_and_runs_once(
    tmp_path: Path,
    postgres_url: str,
    upstream: RecordingUpstream,
    database: TcpProxy,
    direct: asyncpg.Connection,
    unique: Callable[[str], str],
) -> None:
    key = unique("orphan")
    record = record_key(key)
    config = write_config(tmp_path, _config(upstream, lease=LONG_LEASE).model_dump(mode="json"))
    behind = GatewayProcess(
        config,
        env={"GATEWAY_DATABASE_URL": database.rewrite_url(postgres_url)},
        log_dir=tmp_path,
        name="behind-the-cut",
        startup_timeout=STARTUP,
    )
    async with (
        behind,
        GatewayLauncher() as launcher,
        httpx.AsyncClient(base_url=behind.url, timeout=30.0, trust_env=False) as on_behind,
    ):
        beside = await launcher.start(
            _config(upstream, lease=LONG_LEASE), database_url=postgres_url
        )
        on_beside = beside.client
        # The reserve waits on a row the test inserts and has not committed yet.
        blocker = direct.transaction()
        await blocker.start()
        await direct.execute(
            "INSERT INTO idempotency_records (scope, operation, idempotency_key, request_hash, "
            "status, owner_id, fencing_token, lease_expires_at, attempts, body_compressed, "
            "body_omitted, created_at, updated_at, expires_at) VALUES ($1, $2, $3, 'blocker', "
            "'IN_PROGRESS', 'blocker', 1, now(), 1, false, false, now(), now(), "
            "now() + interval '1 hour')",
            *_key_args(record),
        )
        refused = asyncio.create_task(send_keyed(on_behind, key))
        async with _watching(postgres_url) as watcher:
            await eventually(lambda: _blocked_by(watcher, direct.get_server_pid()))
        await database.cut()
        response = await refused
        assert response.status_code == 503, response.text
        assert problem_slug(response.content) == "store-unavailable"

        # The test's row goes; the gateway's reserve commits, with nobody left to hear it.
        await blocker.rollback()
        orphan = await eventually(lambda: _row(direct, record))
        assert orphan["status"] == Status.IN_PROGRESS.value
        assert orphan["owner_id"] != "blocker"

        await database.restore()
        released = await eventually(
            lambda: _row_with_status(direct, record, Status.FAILED_RETRYABLE)
        )
        assert released["owner_id"] == orphan["owner_id"]

        executed = await send_keyed(on_beside, key)
        assert executed.status_code == 201, executed.text
        assert not is_replay(executed)
        await assert_replays(on_behind, key, executed, upstream)


async def test_a_finalize_that_committed_but_lost_its_answer_is_not_counted_as_fenced(
    postgres_url: str,
    upstream: RecordingUpstream,
    database: TcpProxy,
    direct: asyncpg.Connection,
    unique: Callable[[str], str],
) -> None:
    key = unique("committed-finalize")
    record = record_key(key)
    fenced_before = FENCED_WRITES.labels("finalize")._value.get()
    async with GatewayLauncher() as launcher:
        gateway = await _gateway_behind(
            launcher, upstream, database, postgres_url, lease=LONG_LEASE
        )
        answer = await _executing(gateway, upstream, key)
        # The finalize waits on a row lock the test holds.
        holder = direct.transaction()
        await holder.start()
        await direct.execute(
            f"SELECT 1 FROM idempotency_records WHERE {_KEY_MATCHES} FOR UPDATE",
            *_key_args(record),
        )
        upstream.release("run")
        async with _watching(postgres_url) as watcher:
            await eventually(lambda: _blocked_by(watcher, direct.get_server_pid()))
        await database.cut()
        rejected = database.rejected
        # The owner tries again (refused) before the lock goes ...
        await eventually(lambda: database.rejected > rejected)
        await holder.commit()
        # ... and the first finalize commits, its answer lost with the cut connection.
        await eventually(lambda: _row_with_status(direct, record, Status.SUCCEEDED))
        await database.restore()
        response = await answer

    assert response.status_code == 201, response.text
    assert response.json()["key"] == key
    assert FENCED_WRITES.labels("finalize")._value.get() == fenced_before
    assert upstream.count(key) == 1


async def test_a_fenced_off_owner_hands_its_client_the_answer_of_record_whole(
    postgres_url: str,
    upstream: RecordingUpstream,
    database: TcpProxy,
    unique: Callable[[str], str],
) -> None:
    key = unique("fenced-off")
    async with GatewayLauncher() as launcher:
        beside = await launcher.start(_config(upstream, lease="1s"), database_url=postgres_url)
        answer = await _executing_cut_off(launcher, upstream, database, postgres_url, key)
        # The owner cannot renew; once its lease is over a duplicate takes the record over
        # and settles it as "outcome unknown" (on_ambiguous: fail).
        settled = await eventually(lambda: _answered(beside, key, 504), timeout=15.0)
        await database.restore()
        upstream.release("run")
        response = await answer

    # Not the upstream's 201, which is not the key's answer, and not a head cut short.
    assert response.status_code == 504, response.text
    assert is_replay(response)
    assert response.json() == settled.json()
    assert upstream.count(key) == 1


async def _answered(gateway: RunningGateway, key: str, status: int) -> httpx.Response | None:
    response = await send_keyed(gateway.client, key)
    return response if response.status_code == status else None
