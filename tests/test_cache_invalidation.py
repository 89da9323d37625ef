"""An admin delete reaches every worker's in-process replay cache within a stated bound.

A real ``serve --workers 2`` gateway without Redis, on PostgreSQL and on the embedded SQLite:
both workers' caches are warmed with the key's answer, the admin API deletes the record, and
once ``INVALIDATION_BOUND`` has passed no worker replays the old answer any more; the key has
executed afresh exactly once and that new answer is what everyone replays.

And a delete whose row commits after a newer one (ids are taken when an insert starts) is
still applied by a process whose poll already read past it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable

import asyncpg
import httpx
import pytest

from idempotency_gateway.config import StoreConfig
from idempotency_gateway.database_url import asyncpg_dsn_of
from idempotency_gateway.operations.cache_invalidations import POLL_INTERVAL, CacheInvalidations
from idempotency_gateway.replay.cache import CachedAnswer, InProcessCache
from idempotency_gateway.storage import open_store
from idempotency_gateway.storage.records import RecordKey, Status, StoredResponse
from tests.support import GatewayProcess, RecordingUpstream, eventually
from tests.support.charges import CHARGE, CHARGES
from tests.support.keyed import AUTHORIZATION, is_replay, keyed_gateway_config, record_key
from tests.support.servers import StartGatewayProcess
from tests.support.upstream import KEY_HEADER

pytestmark = pytest.mark.slow

TOKEN = "invalidation-admin-token"
# The README's promise: one poll interval plus a query. The slack absorbs a loaded machine.
INVALIDATION_BOUND = POLL_INTERVAL + 2.0
# Concurrent fresh connections spread over both workers' accept loops.
BURST = 10
BURSTS = 4


@pytest.fixture
async def two_workers(
    upstream: RecordingUpstream, start_gateway_process: StartGatewayProcess, database_url: str
) -> GatewayProcess:
    gateway = await start_gateway_process(
        keyed_gateway_config(upstream.url).model_dump(mode="json"),
        env={"GATEWAY_DATABASE_URL": database_url, "GATEWAY_ADMIN_TOKEN": TOKEN},
        extra_args=["--workers", "2"],
    )
    await eventually(
        lambda: gateway.log_text().count("Started server process") >= 2,
        timeout=20.0,
        message="both workers of the gateway started",
    )
    return gateway


@contextlib.asynccontextmanager
async def fresh_connections(url: str) -> AsyncIterator[httpx.AsyncClient]:
    """A client that opens a new connection per request, so requests reach either worker."""
    limits = httpx.Limits(max_keepalive_connections=0)
    async with httpx.AsyncClient(
        base_url=url, limits=limits, timeout=10.0, trust_env=False
    ) as client:
        yield client


async def burst(client: httpx.AsyncClient, key: str) -> list[httpx.Response]:
    headers = {"Authorization": AUTHORIZATION, KEY_HEADER: key}
    return list(
        await asyncio.gather(
            *(client.post(CHARGES, json=CHARGE, headers=headers) for _ in range(BURST))
        )
    )


def executions(answers: list[httpx.Response]) -> set[int]:
    """Which upstream executions the answers carry; a 409 (the key running) carries none."""
    assert {answer.status_code for answer in answers} <= {201, 409}, [a.text for a in answers]
    return {int(a.json()["execution"]) for a in answers if a.status_code == 201}


@pytest.mark.multiprocess
async def test_an_admin_delete_stops_every_worker_replaying_the_old_answer(
    two_workers: GatewayProcess, upstream: RecordingUpstream, unique: Callable[[str], str]
) -> None:
    key = unique("invalidate")
    async with fresh_connections(two_workers.url) as client:
        headers = {"Authorization": AUTHORIZATION, KEY_HEADER: key}
        first = await client.post(CHARGES, json=CHARGE, headers=headers)
        old = int(first.json()["execution"])
        warm: list[httpx.Response] = []
        for _ in range(BURSTS):
            warm += await burst(client, key)
        assert all(is_replay(answer) for answer in warm)
        assert executions(warm) == {old}

        scope = record_key(key).tenant
        deleted = await client.request(
            "DELETE",
            f"{two_workers.admin_url}/admin/records",
            params={"operation": f"POST {CHARGES}", "key": key, "scope": scope},
            headers={"Authorization": f"Bearer {TOKEN}"},
        )
        assert deleted.status_code == 200, deleted.text
        loop = asyncio.get_running_loop()
        bound = loop.time() + INVALIDATION_BOUND

        # Inside the bound a worker may still replay the old answer; keep asking until it ends.
        during: list[httpx.Response] = []
        while loop.time() < bound:
            during += await burst(client, key)
        after: list[httpx.Response] = []
        for _ in range(BURSTS):
            after += await burst(client, key)

    assert executions(during) <= {old, old + 1}
    assert executions(after) == {old + 1}, "a worker replayed the deleted answer"
    assert all(answer.status_code == 201 and is_replay(answer) for answer in after)
    assert upstream.count(key) == 2


def cached(key: RecordKey) -> CachedAnswer:
    response = StoredResponse(200, [], key.idempotency_key.encode())
    return CachedAnswer(key, "hash", Status.SUCCEEDED, response, time.monotonic() + 3600)


async def test_a_delete_committed_after_a_newer_one_is_still_applied(
    postgres_url: str, unique: Callable[[str], str]
) -> None:
    store = open_store(postgres_url, StoreConfig())
    cache = InProcessCache(max_entries=10, max_bytes=1 << 20)
    reader = CacheInvalidations(store, cache)
    # Another process's publisher: its own cache, so only the table tells ``reader``.
    publisher = CacheInvalidations(store, InProcessCache(max_entries=10, max_bytes=1 << 20))
    late, early = (
        RecordKey("scope", f"POST {CHARGES}", unique(name)) for name in ("late", "early")
    )
    slow = await asyncpg.connect(asyncpg_dsn_of(postgres_url))
    try:
        await reader.poll_once()  # a starting process reads where the table ends
        for key in (late, early):
            await cache.put(cached(key))
        # The late delete takes its id first and commits last.
        commit_late = slow.transaction()
        await commit_late.start()
        await slow.execute(
            "INSERT INTO cache_invalidations (scope, operation, idempotency_key, created_at)"
            " VALUES ($1, $2, $3, now())",
            late.tenant,
            late.operation,
            late.idempotency_key,
        )
        await publisher.publish(early)
        await reader.poll_once()
        assert await cache.get(early) is None
        assert await cache.get(late) is not None  # its row is not visible yet

        await commit_late.commit()
        await reader.poll_once()

        assert await cache.get(late) is None, "the late-committed delete was stepped over"
    finally:
        await slow.close()
        await store.close()
