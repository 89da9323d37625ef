"""The replay cache and the wake-ups on a real Redis Cluster of three private nodes.

Entries of keys spread over every slot range are stored and read back, and kept out after an
operator's delete; a wake-up published by
one client reaches a waiter subscribed through another (two gateways' worth of clients); a
primary killed with SIGKILL costs misses, never an exception, readiness names it, and once it
is restarted the cache works again.
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import AsyncIterator, Callable

import pytest
import pytest_asyncio

from idempotency_gateway.replay.cache import CachedAnswer
from idempotency_gateway.replay.redis_cache import RedisCache
from idempotency_gateway.replay.redis_connect import connect_redis
from idempotency_gateway.storage.records import RecordKey, Status, StoredResponse
from tests.support.redis_nodes import RedisClusterNodes, tolerates_dead_node_leaks
from tests.support.waiting import eventually

KEYS = 60  # enough that every one of three primaries owns some


def answer_for(key: RecordKey) -> CachedAnswer:
    response = StoredResponse(status=200, headers=[], body=key.idempotency_key.encode())
    expires_at = time.monotonic() + 3600
    return CachedAnswer(key, "hash-1", Status.SUCCEEDED, response, expires_at)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster() -> AsyncIterator[RedisClusterNodes]:
    async with RedisClusterNodes(3) as nodes:
        yield nodes


@pytest_asyncio.fixture(loop_scope="module")
async def cache(cluster: RedisClusterNodes) -> AsyncIterator[RedisCache]:
    cache = RedisCache(
        connect_redis(cluster.url, timeout=1.0, connect_timeout=1.0),
        timeout=1.0,
        max_entry_bytes=4096,
    )
    yield cache
    await cache.close()


@pytest.fixture
def keys(unique: Callable[[str], str]) -> list[RecordKey]:
    return [RecordKey("scope", "POST /v1/charges", unique(f"cluster-{i}")) for i in range(KEYS)]


pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]


async def test_entries_on_every_node_are_stored_and_replayed(
    cache: RedisCache, keys: list[RecordKey]
) -> None:
    for key in keys:
        assert await cache.put(answer_for(key)) is True
    for key in keys:
        found = await cache.get(key)
        assert found is not None
        assert found.response.body == key.idempotency_key.encode()
    assert await cache.health() == "ok"


async def test_an_operators_delete_keeps_answers_out_on_every_node(
    cache: RedisCache, keys: list[RecordKey]
) -> None:
    """As on one node (``test_replay_cache``): an answer stored after the operator's delete
    of its entry, by a replay that read the record before, is refused."""
    for key in keys:
        await cache.put(answer_for(key))
        assert await cache.delete(key) is True
        assert await cache.put(answer_for(key)) is True  # asked, and refused by the script
    for key in keys:
        assert await cache.get(key) is None
    assert await cache.health() == "ok"


async def test_a_wakeup_published_by_one_client_reaches_a_waiter_of_another(
    cluster: RedisClusterNodes, cache: RedisCache, keys: list[RecordKey]
) -> None:
    waiting_redis = connect_redis(cluster.url, timeout=1.0, connect_timeout=1.0)
    waiting_side = waiting_redis.wakeups(timeout=1.0)
    await waiting_side.start()
    try:
        for key in keys[:6]:
            waiter = asyncio.create_task(waiting_side.wait(key, timeout=20.0))
            # The owner elsewhere stores the answer; its put carries the wake-up. Repeated
            # until the waiter's SSUBSCRIBE is in place: a wake-up before it is lost by design.
            while not waiter.done():
                await cache.put(answer_for(key))
                await asyncio.wait({waiter}, timeout=0.1)
            assert waiter.result() is True
    finally:
        await waiting_side.close()
        await waiting_redis.close()


@tolerates_dead_node_leaks
async def test_a_killed_primary_costs_misses_is_named_and_recovers(
    cluster: RedisClusterNodes, cache: RedisCache, keys: list[RecordKey]
) -> None:
    for key in keys:
        assert await cache.put(answer_for(key))
    victim = cluster.nodes[1]
    await victim.kill()
    # No exception, whatever the key's node: the dead node's keys read as misses.
    results = [await cache.get(key) for key in keys]
    assert any(result is None for result in results)
    assert any(result is not None for result in results)
    assert await cache.health() == f"degraded: {victim.address} not answering"

    await victim.start()
    await cluster.wait_healthy()
    for key in keys:
        # The restarted node lost its entries (no persistence): stored again, read again.
        await cache.put(answer_for(key))

    async def all_found() -> bool:
        return all([await cache.get(key) is not None for key in keys])

    _: bool = await eventually(all_found, timeout=20.0, message="every key readable again")
    assert await cache.health() == "ok"
    # The leaked transports are collected here, under this test's filters, not in a later
    # test after this module's event loop has closed.
    gc.collect()
