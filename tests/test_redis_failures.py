"""What counts as Redis failing: only that is taken soft.

The Redis adapter turns Redis's failures into ``RedisUnavailable`` at its edge, and the
cache and wake-ups turn that into a miss. On a private redis-server: a programming error
(a TypeError) in the cache's own code, or raised from inside a call into the client
library, reaches the caller as it is; a Redis killed with SIGKILL still costs only misses
and unsent wake-ups, each counted by the degradation log, and never an exception.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from redis.asyncio.connection import AbstractConnection

from idempotency_gateway.replay import redis_cache
from idempotency_gateway.replay.cache import CachedAnswer
from idempotency_gateway.replay.redis_adapter import RedisAdapter
from idempotency_gateway.replay.redis_cache import RedisCache
from idempotency_gateway.replay.redis_connect import connect_redis
from idempotency_gateway.storage.records import RecordKey, Status, StoredResponse
from tests.support.redis_nodes import RedisNode


def answer_for(key: RecordKey) -> CachedAnswer:
    response = StoredResponse(status=201, headers=[], body=b"charged")
    return CachedAnswer(key, "hash-1", Status.SUCCEEDED, response, time.monotonic() + 3600)


@pytest.fixture
async def node() -> AsyncIterator[RedisNode]:
    async with RedisNode() as server:
        yield server


@pytest.fixture
async def redis(node: RedisNode) -> AsyncIterator[RedisAdapter]:
    adapter = connect_redis(node.url, timeout=2.0, connect_timeout=2.0)
    yield adapter
    await adapter.close()


@pytest.fixture
def key(unique: Callable[[str], str]) -> RecordKey:
    return RecordKey("scope-failures", "POST /v1/charges", unique("failures"))


def cache_on(redis: RedisAdapter) -> RedisCache:
    return RedisCache(redis, timeout=2.0, max_entry_bytes=4096)


def bug(*args: Any, **kwargs: Any) -> Any:
    raise TypeError("a bug, not Redis failing")


async def test_a_bug_in_the_cache_is_raised_not_taken_for_redis_failing(
    redis: RedisAdapter, key: RecordKey, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = cache_on(redis)
    assert await cache.put(answer_for(key))
    monkeypatch.setattr(redis_cache, "cache_key", bug)

    with pytest.raises(TypeError, match="a bug"):
        await cache.get(key)
    with pytest.raises(TypeError, match="a bug"):
        await cache.put(answer_for(key))
    with pytest.raises(TypeError, match="a bug"):
        await cache.delete(key)

    assert cache.degradation.failures == 0
    monkeypatch.undo()
    found = await cache.get(key)
    assert found is not None
    assert found.response.body == b"charged"


async def test_a_type_error_from_inside_the_client_library_is_raised_too(
    redis: RedisAdapter, key: RecordKey, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = cache_on(redis)
    wakeups = redis.wakeups(timeout=2.0)
    assert await cache.ping()
    monkeypatch.setattr(AbstractConnection, "send_packed_command", bug)

    with pytest.raises(TypeError, match="a bug"):
        await cache.get(key)
    with pytest.raises(TypeError, match="a bug"):
        await wakeups.notify(key)

    assert cache.degradation.failures == wakeups.degradation.failures == 0


async def test_a_killed_redis_costs_misses_and_raises_nothing(
    node: RedisNode, redis: RedisAdapter, key: RecordKey
) -> None:
    cache = cache_on(redis)
    wakeups = redis.wakeups(timeout=2.0)
    assert await cache.put(answer_for(key))
    assert await cache.get(key) is not None

    await node.kill()

    assert await cache.get(key) is None
    assert await cache.put(answer_for(key)) is False
    assert await cache.delete(key) is False
    await wakeups.notify(key)
    assert cache.degradation.failures >= 1
    assert wakeups.degradation.failures == 1
    # Readiness reports it; it raises nothing either.
    assert await cache.health() == "degraded"
