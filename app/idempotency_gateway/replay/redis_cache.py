"""The Redis ``ReplayCache``, built to fail soft, on one node or a Redis Cluster.

Redis down, slow or answering garbage must never surface to a client: every call has a
timeout in milliseconds, every failure is a miss, and a small circuit breaker stops asking a
dead Redis on every request (half-open probes find it again when it returns). Failures are
logged at most once per interval, with the number that were not logged.

Round trips: a replay is one GET; storing an answer is one pipelined SET + PUBLISH, which
also wakes ``Prefer: wait`` waiters in other processes (see ``wakeups``). On a cluster the
wake-up is a sharded SPUBLISH: the key's entry and its channel share a hash tag, so both
commands go to the one node that owns the key, in one round trip.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any, TypeVar

from idempotency_gateway.clock import Monotonic, lease_clock
from idempotency_gateway.config import BreakerConfig
from idempotency_gateway.errors import CircuitOpen
from idempotency_gateway.replay.cache import (
    CachedAnswer,
    cache_key,
    cache_lookups,
    decode,
    encode,
)
from idempotency_gateway.resilience.breaker import BreakerState, CircuitBreaker
from idempotency_gateway.storage.records import RecordKey
from idempotency_gateway.telemetry import tracing
from idempotency_gateway.telemetry.degradation import DegradationLog
from idempotency_gateway.telemetry.metrics import CACHE_LATENCY, Children

if TYPE_CHECKING:
    from redis.asyncio import RedisCluster

    from idempotency_gateway.replay.redis_connection import RedisClient

log = logging.getLogger(__name__)

T = TypeVar("T")

# Open after half of at least five calls failed in ten seconds; probe again after two.
CACHE_BREAKER = BreakerConfig(
    window=10.0, min_calls=5, failure_rate=0.5, slow_call=1.0, open_for=2.0, half_open_calls=1
)


# What a Redis call may raise when Redis is down, slow or killed mid-call: anything at all.
# Redis never decides, so no failure of it may reach a client; and the client library's own
# internals fail in ways no list keeps up with: uvloop's RuntimeError ("the handler is
# closed") under a reconnect's HELLO, RedisClusterException (not a RedisError) for a slot no
# live node covers, an AttributeError when a cluster node's connection is dropped mid-write by
# a concurrent reconnect. Every one found by a fault run dropped a client's connection before
# this caught them all. Cancellation is a BaseException and still passes; each failure is
# logged with its type by the degradation log, so a real bug stays visible.
REDIS_FAILURES: tuple[type[Exception], ...] = (Exception,)

WAKEUP_CHANNEL_PREFIX = "idgw:w:"

_cache_latency = Children(CACHE_LATENCY)


def wakeup_channel(key: RecordKey) -> str:
    """The pub/sub channel a key's waiters listen on; same hash tag as its cache entry."""
    return cache_key(key, prefix=WAKEUP_CHANNEL_PREFIX)


class _Failed:
    """The result of a Redis call that did not happen or did not answer."""


FAILED = _Failed()


class RedisCache:
    shared_across_workers = True

    def __init__(
        self,
        redis: RedisClient,
        *,
        timeout: float,
        max_entry_bytes: int,
        monotonic: Monotonic = lease_clock,
        breaker: CircuitBreaker | None = None,
    ) -> None:
        self.redis = redis
        self.timeout = timeout
        self.max_entry_bytes = max_entry_bytes
        self.breaker = breaker or CircuitBreaker("redis-cache", CACHE_BREAKER)
        self.degradation = DegradationLog("Redis cache", fallback="serving from the durable store")
        self._monotonic = monotonic
        # Imported here: users of the in-process cache need no redis (the [redis] extra).
        from redis.asyncio import Redis, RedisCluster

        from idempotency_gateway.replay.redis_direct import DirectCommands

        self._on_cluster = isinstance(redis, RedisCluster)
        # A single node is asked past redis-py's per-call layers; a cluster needs its routing.
        self._direct = DirectCommands(redis) if isinstance(redis, Redis) else None

    @property
    def degraded(self) -> bool:
        return self.breaker.state is not BreakerState.CLOSED

    async def _guarded(self, operation: str, call: Callable[[], Awaitable[T]]) -> T | _Failed:
        """Run one Redis call under the breaker and a timeout; a failure is a value, never an
        exception, because the cache must never fail a request."""
        span = tracing.cache_span(operation)
        try:
            permit = self.breaker.acquire()
        except CircuitOpen:
            if span is not None:
                span.event("breaker.open", {"gateway.skipped": True})
                span.end()
            return FAILED
        started = time.perf_counter()
        succeeded = False
        try:
            async with asyncio.timeout(self.timeout):
                result = await call()
            succeeded = True
        except Exception as exc:  # any failure of the fast path is a miss, never a 500
            self.degradation.failed(exc)
            if span is not None:
                span.fail(exc)
            return FAILED
        finally:
            _cache_latency(operation).observe(time.perf_counter() - started)
            # Every admitted call reports, cancelled ones too: a half-open probe that never
            # reported would hold the breaker's only permit and refuse Redis for good. A
            # cancelled call counts as failed because nothing proved Redis healthy.
            self.breaker.record(permit, failure=not succeeded)
            if span is not None:
                span.end()
        return result

    async def _get(self, name: str) -> Any:
        if self._direct is not None:
            return (await self._direct.run(("GET", name)))[0]
        return await self.redis.get(name)

    async def get(self, key: RecordKey) -> CachedAnswer | None:
        raw = await self._guarded("get", lambda: self._get(cache_key(key)))
        if raw is FAILED:
            cache_lookups("error").inc()
            return None
        # Redis's own TTL had the entry live when it answered, and it is served at once.
        answer = decode(raw, key, expires_at=self._monotonic()) if isinstance(raw, bytes) else None
        if raw is not None and answer is None:
            self.degradation.failed(ValueError("unreadable cache entry, ignored"))
        if answer is None:
            cache_lookups("miss").inc()
            return None
        cache_lookups("hit").inc()
        return answer

    async def put(self, answer: CachedAnswer) -> bool:
        """Store the answer and wake the key's waiters elsewhere, in one round trip."""
        # Never outlive the record: a TTL of its remaining life, which Redis counts down on
        # its own clock (no host's wall clock is asked).
        ttl_ms = int((answer.expires_at - self._monotonic()) * 1000)
        if ttl_ms <= 0 or len(answer.response.body) > self.max_entry_bytes:
            return False
        value = encode(answer)
        stored = await self._guarded(
            "put", lambda: self._set_and_publish(answer.key, value, ttl_ms)
        )
        return stored is not FAILED

    async def _set_and_publish(self, key: RecordKey, value: bytes, ttl_ms: int) -> None:
        if self._direct is not None:
            await self._direct.run(
                ("SET", cache_key(key), value, "PX", ttl_ms),
                ("PUBLISH", wakeup_channel(key), b"1"),
            )
            return
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.set(cache_key(key), value, px=ttl_ms)
            if self._on_cluster:
                pipe.spublish(wakeup_channel(key), b"1")
            else:
                pipe.publish(wakeup_channel(key), b"1")
            await pipe.execute()

    async def delete(self, key: RecordKey) -> bool:
        """False when Redis could not be asked: the caller decides whether that matters."""
        return (
            await self._guarded("delete", lambda: self.redis.delete(cache_key(key))) is not FAILED
        )

    def invalidate(self, keys: Iterable[RecordKey]) -> None:
        """Nothing to drop: every process reads the one copy in Redis, which the admin API
        deletes itself."""

    def clear(self) -> None:
        """Nothing to drop: this process keeps no copies of its own."""

    async def ping(self) -> bool:
        return await self._guarded("ping", self.redis.ping) is True

    async def health(self) -> str:
        """``ok``, or ``degraded`` naming what does not answer: on a cluster, each primary
        that does not answer a PING (asked directly, past the breaker, which an operator
        looking at readiness wants to see through)."""
        from redis.asyncio import RedisCluster

        if not isinstance(self.redis, RedisCluster):
            return "ok" if await self.ping() else "degraded"
        cluster = self.redis
        try:
            async with asyncio.timeout(self.timeout):
                await cluster.initialize()
        except Exception:  # no seed answered: not one node can be named
            return "degraded: no cluster node answers"
        down = [
            node.name
            for node in cluster.get_primaries()
            if not await self._node_answers(cluster, node.name)
        ]
        return f"degraded: {', '.join(sorted(down))} not answering" if down else "ok"

    async def _node_answers(self, cluster: RedisCluster, name: str) -> bool:
        node = cluster.get_node(node_name=name)
        try:
            async with asyncio.timeout(self.timeout):
                return bool(await cluster.ping(target_nodes=node))
        except Exception:
            return False

    async def close(self) -> None:
        if self._direct is not None:
            await self._direct.close()
        await self.redis.aclose()
