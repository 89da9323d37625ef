"""Shared fixtures: real PostgreSQL and SQLite stores, migrated by Alembic, and real Redis.

``scripts/test`` makes sure PostgreSQL is running and the test database exists; the URL comes
from ``GATEWAY_TEST_DATABASE_URL``. Nothing here is skipped when PostgreSQL is missing: the
suite fails loudly instead, because a store test that did not run proves nothing. Redis comes
from ``GATEWAY_TEST_REDIS_URL`` (default: database 15 of the local server), just as loudly.
The one exception is asked for by name: ``--sqlite-only`` (tests/support/services.py).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio

from idempotency_gateway.config import StoreConfig
from idempotency_gateway.migrate import upgrade_to_head
from idempotency_gateway.storage import open_store
from idempotency_gateway.storage.base import RecordStore
from tests.support import GatewayProcess, RecordingUpstream, write_config
from tests.support.clock import ManualClock
from tests.support.gateway import GatewayLauncher, RunningGateway, StartGateway, gateway_config
from tests.support.keyed import keyed_gateway_config
from tests.support.servers import StartGatewayProcess

pytest_plugins = ["tests.support.services"]

# Several gateway processes, or a fault run, take seconds whatever the test: both are slow.
SLOW_BY_NATURE = ("multiprocess", "faults")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if any(item.get_closest_marker(name) for name in SLOW_BY_NATURE):
            item.add_marker(pytest.mark.slow)
    # Group commit is PostgreSQL's alone: SQLite's half runs once, not once per setting.
    twice = [item for item in items if _sqlite_one_by_one(item)]
    if twice:
        config.hook.pytest_deselected(items=twice)
        items[:] = [item for item in items if not _sqlite_one_by_one(item)]


def _sqlite_one_by_one(item: pytest.Item) -> bool:
    params = getattr(getattr(item, "callspec", None), "params", {})
    return params.get("database_url") == "sqlite" and params.get("store") == "one-by-one"


@pytest.fixture
async def redis_client(redis_url: str) -> AsyncIterator[redis.asyncio.Redis]:
    """A plain client on the tests' Redis database, for looking at (or poisoning) entries."""
    client = redis.asyncio.Redis.from_url(redis_url)
    yield client
    await client.aclose()


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'records.db'}"
    upgrade_to_head(url)
    return url


URL_FIXTURE_OF_STORE = {"postgresql": "postgres_url", "sqlite": "sqlite_url"}


@pytest.fixture(params=list(URL_FIXTURE_OF_STORE))
def database_url(request: pytest.FixtureRequest) -> str:
    """Each test that takes this runs against both stores; the SQLite half needs no server."""
    url: str = request.getfixturevalue(URL_FIXTURE_OF_STORE[request.param])
    return url


@pytest.fixture
def clock() -> ManualClock:
    """One hand-moved time per test, shared by its store and anything else that takes a clock."""
    return ManualClock()


# The default setting in the fast loop; the other in the full run (`slow`), which CI runs.
@pytest.fixture(params=["group-commit", pytest.param("one-by-one", marks=pytest.mark.slow)])
async def store(
    database_url: str, clock: ManualClock, request: pytest.FixtureRequest
) -> AsyncIterator[RecordStore]:
    """Each store test runs with PostgreSQL's group commit on and off (SQLite has none)."""
    config = StoreConfig(group_commit=request.param == "group-commit")
    record_store = open_store(database_url, config, clock=clock.utc)
    yield record_store
    await record_store.close()


@pytest.fixture
def unique() -> Callable[[str], str]:
    """Unique key names, so tests sharing the PostgreSQL database never collide."""
    run = uuid.uuid4().hex[:12]
    return lambda name: f"{name}-{run}"


@pytest.fixture
async def upstream() -> AsyncIterator[RecordingUpstream]:
    """A fresh recording upstream per test: tests count its executions, so none is shared."""
    async with RecordingUpstream() as running:
        yield running


@pytest.fixture
async def start_gateway(upstream: RecordingUpstream) -> AsyncIterator[StartGateway]:
    """In-process gateways on demand (see ``StartGateway``), stopped before ``upstream``."""
    async with GatewayLauncher() as launcher:

        async def start(
            database_url: str,
            *,
            upstream_url: str | None = None,
            redis_url: str | None = None,
            keyed: bool = False,
            **sections: Any,
        ) -> RunningGateway:
            build_config = keyed_gateway_config if keyed else gateway_config
            config = build_config(upstream_url or upstream.url, **sections)
            return await launcher.start(config, database_url=database_url, redis_url=redis_url)

        yield start


@pytest.fixture
async def start_gateway_process(tmp_path: Path) -> AsyncIterator[StartGatewayProcess]:
    """Gateway processes on demand (see ``StartGatewayProcess``), named gateway-0, gateway-1..."""
    started: list[GatewayProcess] = []

    async def start(
        config: dict[str, Any], *, env: dict[str, str], extra_args: Sequence[str] = ()
    ) -> GatewayProcess:
        name = f"gateway-{len(started)}"
        gateway = GatewayProcess(
            write_config(tmp_path, config, name=f"{name}.yaml"),
            env=env,
            extra_args=extra_args,
            log_dir=tmp_path,
            name=name,
        )
        started.append(gateway)
        await gateway.start()
        return gateway

    yield start
    await asyncio.gather(*(gateway.stop() for gateway in started), return_exceptions=True)
    for gateway in started:
        print(f"--- {gateway.name} log tail ---\n{gateway.log_tail()}")
