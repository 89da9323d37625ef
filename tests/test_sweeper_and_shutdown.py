"""Housekeeping and lifecycle: the sweeper, graceful shutdown and ``migrate --wait``.

Proves that the sweeper deletes expired records and nothing else, in batches no larger than
configured, on both stores; that on PostgreSQL only one sweeper runs at a time (another
holding the advisory lock makes it skip, and the ``sweep`` command says so); that ``sweep``
without a database fails with a clear message; that ``serve`` sweeps in the background on its
configured interval; that SIGTERM during a slow request refuses new connections, still
delivers the answer, finalizes the record and ends the process cleanly; and that
``migrate --wait`` waits for a database that comes up late but gives up with exit 1 and a
clear message on one that never does.

The sweeper tests on the shared PostgreSQL database run on a clock set in 2001: only records
written at that time are expired for them, so they never delete another test's rows.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime, timedelta

import httpx
import pytest
from prometheus_client import REGISTRY
from sqlalchemy import delete, func, select
from sqlalchemy.ext.asyncio import AsyncConnection, create_async_engine

from idempotency_gateway.config import StoreConfig, SweeperConfig
from idempotency_gateway.operations.sweeper import Sweeper
from idempotency_gateway.storage import open_store
from idempotency_gateway.storage.base import Claim, RecordStore
from idempotency_gateway.storage.postgres_sql import SWEEP_LOCK_ID
from idempotency_gateway.storage.records import RecordKey, Status
from idempotency_gateway.storage.schema import records
from tests.support import RecordingUpstream, eventually
from tests.support.charges import CHARGES
from tests.support.clock import ManualClock
from tests.support.gateway import unreachable_database_url
from tests.support.keyed import keyed_gateway_config, record_key, send_keyed
from tests.support.servers import PROJECT_ROOT, StartGatewayProcess
from tests.support.tcp_proxy import TcpProxy
from tests.support.upstream import EXECUTION_HEADER

pytestmark = pytest.mark.slow

# Long before any other test's records: on this clock, only this module's rows ever expire.
LONG_AGO = datetime(2001, 1, 1, tzinfo=UTC)
LONG_AGO_ENDS = datetime(2002, 1, 1, tzinfo=UTC)
SHORT_TTL = 60.0
LONG_TTL = 3600.0
OPERATION = "POST /v1/sweep"
CLI = (sys.executable, "-m", "idempotency_gateway.cli")


# ----------------------------------------------------------------------------- helpers


async def write_records(store: RecordStore, names: list[str], *, ttl: float) -> list[RecordKey]:
    """Reserve one record per name on the store's clock, with ``ttl`` seconds to live."""
    keys = [RecordKey("anonymous", OPERATION, name) for name in names]
    for key in keys:
        claim = Claim("f" * 64, os.urandom(16).hex(), lease=min(30.0, ttl), ttl=ttl)
        assert (await store.reserve(key, claim)).reserved
    return keys


async def present(store: RecordStore, keys: list[RecordKey]) -> list[RecordKey]:
    return [key for key in keys if await store.get(key) is not None]


def sweep_batches_run() -> float:
    """Sweep batches run so far by every store of this process, each one DELETE statement."""
    sample = "idempotency_gateway_store_latency_seconds_count"
    return REGISTRY.get_sample_value(sample, {"operation": "sweep"}) or 0.0


class DeleteCounter:
    """Counts the DELETE statements the sweeps send from now on."""

    def __init__(self) -> None:
        self._before = sweep_batches_run()

    @property
    def statements(self) -> float:
        return sweep_batches_run() - self._before


def swept_total() -> float:
    return REGISTRY.get_sample_value("idempotency_gateway_swept_records_total") or 0.0


async def delete_records_written_long_ago(postgres_url: str) -> None:
    engine = create_async_engine(postgres_url)
    try:
        async with engine.begin() as connection:
            await connection.execute(
                # Every module's, not only this one's: other tests that set their clock to
                # 2001 (pgbouncer, the library's sweeper) leave records a sweep here would count.
                delete(records).where(records.c.created_at < LONG_AGO_ENDS)
            )
    finally:
        await engine.dispose()


@pytest.fixture
async def long_ago(clock: ManualClock, postgres_url: str) -> AsyncIterator[ManualClock]:
    """The clock, set in 2001. Records written then (by any test, left over by an interrupted
    run too) are deleted before and after the test, so exact counts hold on PostgreSQL."""
    await delete_records_written_long_ago(postgres_url)
    clock.now = LONG_AGO
    yield clock
    await delete_records_written_long_ago(postgres_url)


@contextlib.asynccontextmanager
async def sweep_lock_held(postgres_url: str) -> AsyncIterator[AsyncConnection]:
    """Another sweeper, as far as PostgreSQL can tell: a session holding the sweep lock."""
    engine = create_async_engine(postgres_url, isolation_level="AUTOCOMMIT")
    try:
        async with engine.connect() as connection:
            await connection.execute(select(func.pg_advisory_lock(SWEEP_LOCK_ID)))
            try:
                yield connection
            finally:
                await connection.execute(select(func.pg_advisory_unlock(SWEEP_LOCK_ID)))
    finally:
        await engine.dispose()


async def run_cli(*args: str, env: dict[str, str]) -> tuple[int, str, float]:
    """Run the real CLI; return its exit code, its output and how long it ran."""
    started = time.monotonic()
    process = await asyncio.create_subprocess_exec(
        *CLI,
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env={**os.environ, **env},
        cwd=PROJECT_ROOT,
    )
    output, _ = await asyncio.wait_for(process.communicate(), 60.0)
    assert process.returncode is not None
    return process.returncode, output.decode(), time.monotonic() - started


# ----------------------------------------------------------------------------- sweeper


async def test_sweeper_deletes_only_expired_records_in_bounded_batches(
    store: RecordStore, long_ago: ManualClock, unique: Callable[[str], str]
) -> None:
    expired = await write_records(store, [unique(f"old-{n}") for n in range(5)], ttl=SHORT_TTL)
    live = await write_records(store, [unique(f"live-{n}") for n in range(2)], ttl=LONG_TTL)
    long_ago.advance(SHORT_TTL * 2)
    deletes = DeleteCounter()
    swept_before = swept_total()

    # One batch only: exactly the batch size goes.
    assert await store.sweep(batch_size=2, max_batches=1) == 2
    assert len(await present(store, expired)) == 3
    assert deletes.statements == 1

    # The sweeper runs batches until one comes back short: 2, then 1.
    sweeper = Sweeper(store, SweeperConfig(interval=60.0, batch_size=2))
    assert await sweeper.sweep_once() == 3
    assert deletes.statements == 3

    assert await present(store, expired) == []
    assert await present(store, live) == live
    assert swept_total() - swept_before == 3
    assert await sweeper.sweep_once() == 0


async def test_sweeper_keeps_a_record_until_its_expiry(
    store: RecordStore, long_ago: ManualClock, unique: Callable[[str], str]
) -> None:
    (key,) = await write_records(store, [unique("edge")], ttl=SHORT_TTL)
    sweeper = Sweeper(store, SweeperConfig(batch_size=10))

    long_ago.advance(SHORT_TTL - 1)
    assert await sweeper.sweep_once() == 0
    assert await present(store, [key]) == [key]

    long_ago.advance(1)
    assert await sweeper.sweep_once() == 1
    assert await present(store, [key]) == []


async def test_only_one_sweeper_runs_at_a_time_on_postgresql(
    postgres_url: str, long_ago: ManualClock, unique: Callable[[str], str]
) -> None:
    stores = [open_store(postgres_url, StoreConfig(), clock=long_ago.utc) for _ in "ab"]
    sweepers = [Sweeper(store, SweeperConfig(batch_size=10)) for store in stores]
    try:
        expired = await write_records(stores[0], [unique("contended")], ttl=SHORT_TTL)
        long_ago.advance(SHORT_TTL * 2)

        async with sweep_lock_held(postgres_url):
            # Both gateways' sweepers find another one at work and skip, deleting nothing.
            assert await asyncio.gather(*(s.sweep_once() for s in sweepers)) == [None, None]
            assert await present(stores[0], expired) == expired

        assert await sweepers[1].sweep_once() == 1
        assert await present(stores[0], expired) == []
    finally:
        for store in stores:
            await store.close()


async def test_sweep_command_says_another_sweeper_is_running(
    postgres_url: str, long_ago: ManualClock, unique: Callable[[str], str]
) -> None:
    store = open_store(postgres_url, StoreConfig(), clock=long_ago.utc)
    try:
        expired = await write_records(store, [unique("cli-contended")], ttl=SHORT_TTL)

        async with sweep_lock_held(postgres_url):
            code, output, _ = await run_cli("sweep", env={"GATEWAY_DATABASE_URL": postgres_url})

        assert code == 0, output
        assert "another sweeper is running" in output
        assert await present(store, expired) == expired
    finally:
        await store.close()


async def test_sweep_command_fails_clearly_without_a_database() -> None:
    code, output, _ = await run_cli(
        "sweep", env={"GATEWAY_DATABASE_URL": unreachable_database_url()}
    )

    assert code == 1, output
    assert "error: the database does not answer" in output
    assert "Traceback" not in output


@pytest.mark.multiprocess
async def test_serve_sweeps_expired_records_in_the_background(
    start_gateway_process: StartGatewayProcess, sqlite_url: str, unique: Callable[[str], str]
) -> None:
    # The gateway's own SQLite file: a real-time sweeper every 200 ms must not touch the
    # shared PostgreSQL database, where other tests' records expire on their own clocks.
    clock = ManualClock()
    store = open_store(sqlite_url, StoreConfig(), clock=clock.utc)
    clock.now = datetime.now(UTC) - timedelta(days=1)
    expired = await write_records(store, [unique("expired")], ttl=SHORT_TTL)
    clock.now = datetime.now(UTC)
    live = await write_records(store, [unique("live")], ttl=LONG_TTL)
    config = keyed_gateway_config("http://127.0.0.1:9", sweeper={"interval": "200ms"})
    try:
        gateway = await start_gateway_process(
            config.model_dump(mode="json"), env={"GATEWAY_DATABASE_URL": sqlite_url}
        )
        async with httpx.AsyncClient(timeout=10.0, trust_env=False) as client:

            async def swept() -> bool:
                return await present(store, expired) == []

            await eventually(swept, timeout=10.0, message="the background sweep ran")

            # The counter moves after the batch's DELETE commits: poll for it, don't race it.
            async def counted() -> bool:
                metrics = await client.get(gateway.admin_url + "/metrics")
                return "idempotency_gateway_swept_records_total 1.0" in metrics.text

            await eventually(counted, timeout=10.0, message="the sweep was counted once")

        assert await present(store, live) == live
    finally:
        await store.close()


# ---------------------------------------------------------------------------- shutdown


async def connection_refused(host: str, port: int) -> bool:
    try:
        _, writer = await asyncio.open_connection(host, port)
    except ConnectionRefusedError:
        return True
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return False


@pytest.mark.multiprocess
async def test_sigterm_finishes_the_slow_request_and_exits_cleanly(
    start_gateway_process: StartGatewayProcess, postgres_url: str, unique: Callable[[str], str]
) -> None:
    key = unique("shutdown")
    async with RecordingUpstream() as upstream:
        store = open_store(postgres_url, StoreConfig())
        try:
            async with httpx.AsyncClient(timeout=20.0, trust_env=False) as client:
                gateway = await start_gateway_process(
                    keyed_gateway_config(upstream.url).model_dump(mode="json"),
                    env={"GATEWAY_DATABASE_URL": postgres_url},
                )
                slow = asyncio.create_task(
                    send_keyed(client, key, path=gateway.url + CHARGES, behavior="gate=slow")
                )
                await upstream.wait_arrived("slow")

                gateway.terminate()

                await eventually(
                    lambda: connection_refused(gateway.host, gateway.port),
                    message="the proxy port refuses new connections after SIGTERM",
                )
                assert await connection_refused(gateway.host, gateway.admin_port)
                assert not slow.done()
                upstream.release("slow")
                answer = await slow

            assert answer.status_code == 201
            assert answer.headers[EXECUTION_HEADER] == "1"
            # A clean drain exits 0 (the supervisor answers for its workers).
            assert await gateway.wait(timeout=20.0) == 0
            log = gateway.log_text()
            assert "Application shutdown complete" in log
            assert "Traceback" not in log
            assert "still running at shutdown" not in log
            record = await store.get(record_key(key))
            assert record is not None
            assert record.status is Status.SUCCEEDED
            assert record.response is not None
            assert record.response.body == answer.content
            assert upstream.count(key) == 1
        finally:
            await store.close()


# ----------------------------------------------------------------------------- migrate


async def test_migrate_waits_for_a_database_that_comes_up_late(postgres_url: str) -> None:
    async with TcpProxy("127.0.0.1", 5432) as database:
        await database.cut()
        migrate = asyncio.create_task(
            run_cli(
                "migrate",
                "--wait",
                "5",
                env={"GATEWAY_DATABASE_URL": database.rewrite_url(postgres_url)},
            )
        )
        try:
            await eventually(
                lambda: database.rejected >= 1 or migrate.done(),
                timeout=10.0,
                message="migrate tried the database while it was down",
            )
            assert not migrate.done(), migrate.result()
            await database.restore()
            code, output, _ = await migrate
        finally:
            migrate.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await migrate

    assert code == 0, output
    assert "schema is at the newest migration" in output
    assert database.forwarded >= 1


async def test_migrate_gives_up_on_a_database_that_never_answers() -> None:
    code, output, elapsed = await run_cli(
        "migrate", "--wait", "1", env={"GATEWAY_DATABASE_URL": unreachable_database_url()}
    )

    assert code == 1, output
    assert "error: the database does not answer" in output
    assert "Traceback" not in output
    assert elapsed >= 1.0
