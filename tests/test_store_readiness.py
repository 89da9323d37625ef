"""``/readyz`` checks what a keyed request needs, and the request path gets its connections
first: at PostgreSQL's connection limit a running gateway keeps serving keyed requests while
a gateway that cannot get a connection of its own says it is not ready (and answers keyed
requests with a clear 503); on a read-only database (a failover onto a standby) readiness
fails and keyed requests get a 503 that says so, with no driver's class name in it.

Each test runs real gateways (a process of its own, or served in the test's process) on a
PostgreSQL database and role of its own: the
role's connection limit stands for the server's, and ``default_transaction_read_only`` on the
database stands for a standby, so nothing the other tests share is touched.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import asyncpg
import httpx
import pytest

from idempotency_gateway.config import GatewayConfig
from idempotency_gateway.database_url import asyncpg_dsn_of
from idempotency_gateway.migrate import upgrade_to_head_async
from tests.support import GatewayProcess, RecordingUpstream, eventually, write_config
from tests.support.gateway import GatewayLauncher, RunningGateway
from tests.support.keyed import assert_replays, keyed_gateway_config, send_keyed
from tests.support.problems import problem_slug

# Pools held busy until readiness answers: seconds. test_store keeps the store in the fast
# loop.
pytestmark = pytest.mark.slow

# Per gateway process: the request path's pool (all of it opened at startup) and the admin
# paths' pool (never more than two).
REQUEST_POOL = 2
ADMIN_POOL = 2
# What two gateways need at most: the limit the tests' role gets.
CONNECTION_LIMIT = 2 * (REQUEST_POOL + ADMIN_POOL)
STARTUP = 60.0
# Driver words a client must never read in a problem.
DRIVER_WORDS = ("asyncpg", "Error", "sqlstate")


@contextlib.asynccontextmanager
async def private_database(postgres_url: str, *, connection_limit: int) -> AsyncIterator[str]:
    """A migrated database owned by a role of its own with ``connection_limit`` connections;
    its URL, which connects as that role. Both are dropped afterwards."""
    name = f"igw_ready_{uuid.uuid4().hex[:12]}"
    admin = await asyncpg.connect(asyncpg_dsn_of(postgres_url))
    try:
        await admin.execute(f'CREATE ROLE "{name}" LOGIN CONNECTION LIMIT {connection_limit}')
        await admin.execute(f'CREATE DATABASE "{name}" OWNER "{name}"')
        base, _, _ = postgres_url.rpartition("/")
        url = f"{base}/{name}".replace("//postgres@", f"//{name}@", 1)
        await upgrade_to_head_async(url)
        yield url
    finally:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.execute(f'DROP ROLE IF EXISTS "{name}"')
        await admin.close()


@contextlib.asynccontextmanager
async def every_free_slot(url: str) -> AsyncIterator[int]:
    """Hold every connection the role may still open; how many that was."""
    held: list[asyncpg.Connection] = []
    try:
        while True:
            try:
                held.append(await asyncpg.connect(asyncpg_dsn_of(url)))
            except asyncpg.TooManyConnectionsError:
                break
        yield len(held)
    finally:
        for connection in held:
            await connection.close()


def _config(upstream: RecordingUpstream) -> GatewayConfig:
    return keyed_gateway_config(
        upstream.url, store={"pool_size": REQUEST_POOL, "pool_min_size": REQUEST_POOL}
    )


def _admin_of(gateway: RunningGateway) -> httpx.AsyncClient:
    """The admin API of a gateway served in the test's own process."""
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=gateway.app.admin), base_url="http://admin"
    )


def _gateway(tmp_path: Path, upstream: RecordingUpstream, url: str, name: str) -> GatewayProcess:
    return GatewayProcess(
        write_config(tmp_path, _config(upstream).model_dump(mode="json"), name=f"{name}.yaml"),
        env={"GATEWAY_DATABASE_URL": url},
        log_dir=tmp_path,
        name=name,
        startup_timeout=STARTUP,
    )


def _client(base_url: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=base_url, timeout=30.0, trust_env=False)


def _readiness(
    admin: httpx.AsyncClient, status: int
) -> Callable[[], Awaitable[dict[str, str] | None]]:
    async def answers() -> dict[str, str] | None:
        response = await admin.get("/readyz")
        return response.json() if response.status_code == status else None

    return answers


def _assert_clear_store_problem(response: httpx.Response) -> None:
    assert response.status_code == 503, response.text
    assert problem_slug(response.content) == "store-unavailable"
    for word in DRIVER_WORDS:
        assert word not in response.text, response.text


async def test_at_the_connection_limit_the_request_path_has_its_connections_first(
    tmp_path: Path,
    postgres_url: str,
    upstream: RecordingUpstream,
    unique: Callable[[str], str],
) -> None:
    key = unique("at-the-limit")
    async with (
        private_database(postgres_url, connection_limit=CONNECTION_LIMIT) as url,
        GatewayLauncher() as launcher,
        contextlib.AsyncExitStack() as stack,
    ):
        first = await stack.enter_async_context(_gateway(tmp_path, upstream, url, "first"))
        on_first = await stack.enter_async_context(_client(first.url))
        first_admin = await stack.enter_async_context(_client(first.admin_url))
        await eventually(_readiness(first_admin, 200), timeout=STARTUP)
        async with every_free_slot(url) as taken:
            assert taken > 0
            executed = await send_keyed(on_first, key)
            assert executed.status_code == 201, executed.text
            assert (await first_admin.get("/readyz")).status_code == 200

            second = await launcher.start(_config(upstream), database_url=url)
            on_second = second.client
            second_admin = await stack.enter_async_context(_admin_of(second))
            not_ready = await second_admin.get("/readyz")
            assert not_ready.status_code == 503, not_ready.text
            assert not_ready.json()["store"] == "down"
            _assert_clear_store_problem(await send_keyed(on_second, key))
        # The slots are free again: the second gateway gets connections of its own.
        await eventually(_readiness(second_admin, 200), timeout=STARTUP)
        await assert_replays(on_second, key, executed, upstream)


async def test_a_read_only_database_fails_readiness_and_keyed_requests_say_why(
    tmp_path: Path,
    postgres_url: str,
    upstream: RecordingUpstream,
    unique: Callable[[str], str],
) -> None:
    async with (
        private_database(postgres_url, connection_limit=-1) as url,
        GatewayLauncher() as launcher,
        contextlib.AsyncExitStack() as stack,
    ):
        database = url.rpartition("/")[2]
        admin = await asyncpg.connect(asyncpg_dsn_of(postgres_url))
        stack.push_async_callback(admin.close)

        async def fail_over(read_only: bool) -> None:
            """New sessions on the database refuse writes (or take them again), and every
            session the gateway holds ends, as a failover would end them."""
            setting = "SET default_transaction_read_only = on" if read_only else "RESET ALL"
            await admin.execute(f'ALTER DATABASE "{database}" {setting}')
            await admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1",
                database,
            )

        gateway = await launcher.start(_config(upstream), database_url=url)
        client = gateway.client
        readiness = await stack.enter_async_context(_admin_of(gateway))
        await eventually(_readiness(readiness, 200), timeout=STARTUP)

        await fail_over(read_only=True)
        not_ready = await eventually(_readiness(readiness, 503), timeout=STARTUP)
        await eventually(
            lambda: _store_state(readiness, "read-only"),
            timeout=STARTUP,
        )
        refused = await send_keyed(client, unique("read-only"))
        _assert_clear_store_problem(refused)
        assert "read-only" in refused.json()["detail"]

        await fail_over(read_only=False)
        await eventually(_readiness(readiness, 200), timeout=STARTUP)
        key = unique("writable-again")
        executed = await send_keyed(client, key)
    assert not_ready["status"] == "not ready"
    assert executed.status_code == 201, executed.text
    assert upstream.count(key) == 1


async def _store_state(readiness: httpx.AsyncClient, state: str) -> bool:
    return bool((await readiness.get("/readyz")).json().get("store") == state)
