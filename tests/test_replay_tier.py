"""Finished answers kept in each process in front of Redis, and a Redis deadline that judges
Redis, not the event loop.

Proves that a replay from the in-process tier is still checked against the request's hash
(a different request on the key is a 422, never the stored answer), that a copy taken from
Redis dies when Redis's entry would, that an admin delete on one gateway process makes
another stop replaying its copy, and that a loop stalled while Redis's reply waited in the
socket still gets the reply instead of a timeout.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import httpx
import pytest
import redis.asyncio

from idempotency_gateway.replay.cache import InProcessCache, cache_key
from idempotency_gateway.replay.redis_cache import RedisCache
from idempotency_gateway.replay.redis_connect import connect_redis
from idempotency_gateway.replay.tiered_cache import TieredCache
from idempotency_gateway.storage.records import RecordKey
from tests.support import GatewayProcess, RecordingUpstream, eventually, write_config
from tests.support.charges import CHARGE, CHARGES
from tests.support.clock import ManualClock
from tests.support.gateway import RunningGateway, StartGateway
from tests.support.keyed import (
    is_replay,
    keyed_gateway_config,
    record_key,
    send_keyed,
)
from tests.test_replay_cache import answer_for

TOKEN = "tier-admin-token"


@pytest.fixture
def fresh_key(unique: Callable[[str], str]) -> RecordKey:
    return RecordKey("scope-tier", "POST /v1/charges", unique("tier"))


@pytest.fixture
async def tiered_gateway(
    start_gateway: StartGateway, postgres_url: str, redis_url: str
) -> RunningGateway:
    """The production shape: PostgreSQL decides, Redis and each process's copies cache."""
    return await start_gateway(postgres_url, keyed=True, redis_url=redis_url)


def tier_of(gateway: RunningGateway) -> TieredCache:
    cache = gateway.app.cache
    assert isinstance(cache, TieredCache)
    return cache


async def test_a_replay_from_memory_is_checked_against_the_request_hash(
    tiered_gateway: RunningGateway,
    upstream: RecordingUpstream,
    redis_client: redis.asyncio.Redis,
    unique: Callable[[str], str],
) -> None:
    key = unique("memory-422")
    original = await send_keyed(tiered_gateway.client, key)
    # Only this process's copy is left: Redis's entry is gone, so is nothing else to ask.
    assert await redis_client.delete(cache_key(record_key(key))) == 1
    assert tier_of(tiered_gateway).memory.lookup(record_key(key)) is not None

    replay = await send_keyed(tiered_gateway.client, key)
    reused = await send_keyed(tiered_gateway.client, key, json={**CHARGE, "amount": 2000})

    assert original.status_code == 201
    assert (replay.status_code, is_replay(replay), replay.content) == (
        201,
        True,
        original.content,
    )
    assert reused.status_code == 422
    assert not is_replay(reused)
    assert await redis_client.exists(cache_key(record_key(key))) == 0, "served from memory"
    assert upstream.count(key) == 1


async def test_a_copy_from_redis_dies_when_redis_entry_would(
    redis_url: str, fresh_key: RecordKey
) -> None:
    clock = ManualClock()
    adapter = connect_redis(redis_url, timeout=1.0, connect_timeout=1.0)
    shared = RedisCache(adapter, timeout=1.0, max_entry_bytes=1 << 20, monotonic=clock)
    tier = TieredCache(InProcessCache(max_entries=10, max_bytes=1 << 20, monotonic=clock), shared)
    writer = RedisCache(adapter, timeout=1.0, max_entry_bytes=1 << 20)
    try:
        # Redis keeps the entry for 5 s more (its TTL); this process never wrote it.
        await writer.put(answer_for(fresh_key, expires_in=5.0))

        found = await tier.get(fresh_key)
        copy = tier.memory.lookup(fresh_key)
        assert found is not None
        assert copy is not None
        assert clock() < copy.expires_at <= clock() + 5.0

        clock.advance(5.0)
        assert tier.memory.lookup(fresh_key) is None
    finally:
        await tier.close()


async def test_a_stalled_loop_does_not_turn_a_redis_reply_into_a_timeout(
    redis_url: str, fresh_key: RecordKey
) -> None:
    """The reply arrives while a task blocks the loop for far longer than the timeout: the
    deadline's timer runs late, and Redis, which answered in time, is not blamed."""
    timeout = 0.05
    cache = RedisCache(
        connect_redis(redis_url, timeout=timeout, connect_timeout=1.0),
        timeout=timeout,
        max_entry_bytes=1 << 20,
    )
    try:
        await cache.put(answer_for(fresh_key))  # also leaves a connected, idle connection

        async def stall() -> None:
            # Blocks the loop on purpose: no socket is read meanwhile.
            time.sleep(timeout * 6)  # noqa: ASYNC251

        # The lookup runs first and sends its GET; the stall runs next, before any reply.
        lookup = asyncio.create_task(cache.get(fresh_key))
        stalled = asyncio.create_task(stall())
        found = await lookup
        await stalled
    finally:
        await cache.close()

    assert found is not None, "the reply was there; the loop was late, not Redis"
    assert cache.degradation.failures == 0
    assert not cache.degraded


@pytest.fixture
async def two_gateways(
    tmp_path: Path, upstream: RecordingUpstream, postgres_url: str, redis_url: str
) -> AsyncIterator[tuple[GatewayProcess, GatewayProcess]]:
    config = write_config(tmp_path, keyed_gateway_config(upstream.url).model_dump(mode="json"))
    env = {
        "GATEWAY_DATABASE_URL": postgres_url,
        "GATEWAY_REDIS_URL": redis_url,
        "GATEWAY_ADMIN_TOKEN": TOKEN,
    }
    first = GatewayProcess(config, env=env, log_dir=tmp_path, name="first")
    second = GatewayProcess(config, env=env, log_dir=tmp_path, name="second")
    async with first, second:
        yield first, second


def execution_of(answer: httpx.Response) -> int:
    assert answer.status_code == 201, answer.text
    return int(answer.json()["execution"])


@pytest.mark.slow
@pytest.mark.multiprocess
async def test_an_admin_delete_on_one_process_stops_another_replaying_its_copy(
    two_gateways: tuple[GatewayProcess, GatewayProcess],
    upstream: RecordingUpstream,
    unique: Callable[[str], str],
) -> None:
    first, second = two_gateways
    key = unique("tier-delete")
    async with (
        httpx.AsyncClient(base_url=first.url, timeout=10.0, trust_env=False) as on_first,
        httpx.AsyncClient(base_url=second.url, timeout=10.0, trust_env=False) as on_second,
    ):
        old = execution_of(await send_keyed(on_first, key))
        # The second process copies the answer from Redis into its own memory.
        warm = [await send_keyed(on_second, key) for _ in range(3)]
        assert all(is_replay(answer) and execution_of(answer) == old for answer in warm)

        deleted = await on_first.request(
            "DELETE",
            f"{first.admin_url}/admin/records",
            params={"operation": f"POST {CHARGES}", "key": key, "scope": record_key(key).tenant},
            headers={"Authorization": f"Bearer {TOKEN}"},
        )
        assert deleted.status_code == 200, deleted.text

        async def second_executes_afresh() -> bool:
            return execution_of(await send_keyed(on_second, key)) != old

        await eventually(
            second_executes_afresh, timeout=20.0, message="the second process dropped its copy"
        )
        after = [await send_keyed(client, key) for client in (on_first, on_second)]

    assert [execution_of(answer) for answer in after] == [old + 1, old + 1]
    assert all(is_replay(answer) for answer in after)
    assert upstream.count(key) == 2
