"""The Redis ``ReplayCache``, built to fail soft.

Redis down, slow or answering garbage must never surface to a client: every call has a
timeout in milliseconds, every failure is a miss, and a small circuit breaker stops asking a
dead Redis on every request (half-open probes find it again when it returns). Failures are
logged at most once per interval, with the number that were not logged.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import TypeVar

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from idempotency_gateway.config import BreakerConfig
from idempotency_gateway.errors import CircuitOpen
from idempotency_gateway.idempotency.cache import CachedAnswer, cache_key, decode, encode
from idempotency_gateway.idempotency.record import RecordKey
from idempotency_gateway.idempotency.store import utc_now
from idempotency_gateway.resilience.breaker import BreakerState, CircuitBreaker
from idempotency_gateway.telemetry.degradation import DegradationLog
from idempotency_gateway.telemetry.metrics import CACHE_LATENCY, CACHE_LOOKUPS

log = logging.getLogger(__name__)

T = TypeVar("T")

# Open after half of at least five calls failed in ten seconds; probe again after two.
CACHE_BREAKER = BreakerConfig(
    window=10.0, min_calls=5, failure_rate=0.5, slow_call=1.0, open_for=2.0, half_open_calls=1
)


# What a Redis call raises when Redis is down, slow or killed mid-call. uvloop raises
# RuntimeError ("the handler is closed") when the connection dies under a write, such as the
# HELLO of a reconnect: found by the fault suite, a 500 to the client before it was listed.
REDIS_FAILURES = (RedisError, OSError, TimeoutError, RuntimeError)


class _Failed:
    """The result of a Redis call that did not happen or did not answer."""


FAILED = _Failed()


def connect_redis(url: str, *, timeout: float | None, connect_timeout: float) -> Redis:
    """``timeout=None`` for a pub/sub subscriber, whose reads wait for messages. (The
    ``hiredis`` extra makes redis-py parse replies in C: about a sixth more new keys per
    second through a worker.)"""
    return Redis.from_url(
        url,
        socket_timeout=timeout,
        socket_connect_timeout=connect_timeout,
        # The breaker decides when to try again; the client must not stall a request retrying.
        retry=Retry(NoBackoff(), 0),
        health_check_interval=0,
    )


class RedisCache:
    def __init__(
        self,
        redis: Redis,
        *,
        timeout: float,
        max_entry_bytes: int,
        clock: Callable[[], datetime] = utc_now,
    ) -> None:
        self.redis = redis
        self.timeout = timeout
        self.max_entry_bytes = max_entry_bytes
        self.breaker = CircuitBreaker("redis-cache", CACHE_BREAKER)
        self.degradation = DegradationLog("Redis cache", fallback="serving from the durable store")
        self._clock = clock

    @property
    def degraded(self) -> bool:
        return self.breaker.state is not BreakerState.CLOSED

    async def _guarded(self, operation: str, call: Callable[[], Awaitable[T]]) -> T | _Failed:
        """Run one Redis call under the breaker and a timeout; a failure is a value, never an
        exception, because the cache must never fail a request."""
        try:
            permit = self.breaker.acquire()
        except CircuitOpen:
            return FAILED
        started = time.perf_counter()
        try:
            async with asyncio.timeout(self.timeout):
                result = await call()
        except REDIS_FAILURES as exc:
            self.breaker.record(permit, failure=True)
            self.degradation.failed(exc)
            return FAILED
        finally:
            CACHE_LATENCY.labels(operation).observe(time.perf_counter() - started)
        self.breaker.record(permit, failure=False)
        return result

    async def get(self, key: RecordKey) -> CachedAnswer | None:
        raw = await self._guarded("get", lambda: self.redis.get(cache_key(key)))
        if raw is FAILED:
            CACHE_LOOKUPS.labels("error").inc()
            return None
        answer = decode(raw, key) if isinstance(raw, bytes) else None
        if raw is not None and answer is None:
            self.degradation.failed(ValueError("unreadable cache entry, ignored"))
        if answer is None or not answer.is_live(self._clock()):
            CACHE_LOOKUPS.labels("miss").inc()
            return None
        CACHE_LOOKUPS.labels("hit").inc()
        return answer

    async def put(self, answer: CachedAnswer) -> None:
        # Never outlive the record: the entry dies when the record expires.
        ttl_ms = int((answer.expires_at - self._clock().timestamp()) * 1000)
        if ttl_ms <= 0 or len(answer.response.body) > self.max_entry_bytes:
            return
        value = encode(answer)
        await self._guarded("put", lambda: self.redis.set(cache_key(answer.key), value, px=ttl_ms))

    async def delete(self, key: RecordKey) -> bool:
        """False when Redis could not be asked: the caller decides whether that matters."""
        return (
            await self._guarded("delete", lambda: self.redis.delete(cache_key(key))) is not FAILED
        )

    async def ping(self) -> bool:
        return await self._guarded("ping", self.redis.ping) is True

    async def close(self) -> None:
        await self.redis.aclose()
