"""``TieredCache``: this process's own copies of finished answers in front of Redis.

A replay from Redis pays a round trip, the guard around it and a decode: more than a proxied
request. A finished answer never changes while its record lives, so each process keeps the
ones it served lately in an ``InProcessCache`` (bounded by ``cache.max_entries`` and
``cache.max_bytes``) and asks Redis only on a miss there. An entry copied from Redis lives
no longer than Redis would have kept it: its remaining TTL comes back with the value.

What the in-process tier changes is who must hear of an operator's delete: Redis is one copy
for everyone, the in-process copies are one per process. So this cache is not
``shared_across_workers``: the gateway runs ``CacheInvalidations`` for it, the admin API
deletes the Redis entry and publishes the key, and every process drops its copy when it reads
the key (``invalidate``), keeping it out for ``INVALIDATION_GUARD`` so a Redis read that was
under way cannot put the old answer back.
"""

from __future__ import annotations

from collections.abc import Iterable

from idempotency_gateway.replay.cache import CachedAnswer, InProcessCache, cache_lookups
from idempotency_gateway.replay.redis_cache import RedisCache
from idempotency_gateway.storage.records import RecordKey


class TieredCache:
    shared_across_workers = False

    def __init__(self, memory: InProcessCache, redis: RedisCache) -> None:
        self.memory = memory
        self.redis = redis

    async def get(self, key: RecordKey) -> CachedAnswer | None:
        answer = self.memory.lookup(key)
        if answer is not None:
            cache_lookups("hit").inc()
            return answer
        answer = await self.redis.get_with_expiry(key)
        if answer is not None:
            await self.memory.put(answer)
        return answer

    async def put(self, answer: CachedAnswer) -> bool:
        await self.memory.put(answer)
        return await self.redis.put(answer)

    async def delete(self, key: RecordKey) -> bool:
        await self.memory.delete(key)
        return await self.redis.delete(key)

    def invalidate(self, keys: Iterable[RecordKey]) -> None:
        self.memory.invalidate(keys)

    def clear(self) -> None:
        self.memory.clear()

    async def health(self) -> str:
        return await self.redis.health()

    async def close(self) -> None:
        self.memory.clear()
        await self.redis.close()
