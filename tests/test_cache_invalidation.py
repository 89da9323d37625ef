"""An admin delete reaches every worker's in-process replay cache within a stated bound.

A real ``serve --workers 2`` gateway without Redis, on PostgreSQL and on the embedded SQLite:
both workers' caches are warmed with the key's answer, the admin API deletes the record, and
once ``INVALIDATION_BOUND`` has passed no worker replays the old answer any more; the key has
executed afresh exactly once and that new answer is what everyone replays.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import httpx
import pytest

from idempotency_gateway.operations.cache_invalidations import POLL_INTERVAL
from tests.support import GatewayProcess, RecordingUpstream, eventually, write_config
from tests.support.charges import CHARGE, CHARGES
from tests.support.keyed import AUTHORIZATION, is_replay, keyed_gateway_config, record_key
from tests.support.upstream import KEY_HEADER

pytestmark = pytest.mark.multiprocess

TOKEN = "invalidation-admin-token"
# The README's promise: one poll interval plus a query. The slack absorbs a loaded machine.
INVALIDATION_BOUND = POLL_INTERVAL + 2.0
# Concurrent fresh connections spread over both workers' accept loops.
BURST = 10
BURSTS = 4


@pytest.fixture
async def two_workers(
    tmp_path: Path, upstream: RecordingUpstream, database_url: str
) -> AsyncIterator[GatewayProcess]:
    config = keyed_gateway_config(upstream.url)
    gateway = GatewayProcess(
        write_config(tmp_path, config.model_dump(mode="json")),
        env={"GATEWAY_DATABASE_URL": database_url, "GATEWAY_ADMIN_TOKEN": TOKEN},
        extra_args=["--workers", "2"],
        log_dir=tmp_path,
    )
    async with gateway:
        await eventually(
            lambda: gateway.log_text().count("Started server process") >= 2,
            timeout=20.0,
            message="both workers of the gateway started",
        )
        yield gateway


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

        scope = record_key(key).scope
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
