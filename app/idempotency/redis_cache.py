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
from datetime import UTC, datetime
from typing import TypeVar

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from app.config import BreakerConfig
from app.errors import CircuitOpen
from app.idempotency.cache import CachedAnswer, cache_key, decode, encode
from app.idempotency.record import RecordKey
from app.resilience.breaker import BreakerState, CircuitBreaker

log = logging.getLogger(__name__)

T = TypeVar("T")

# Open after half of at least five calls failed in ten seconds; probe again after two.
CACHE_BREAKER = BreakerConfig(
    window=10.0, min_calls=5, failure_rate=0.5, slow_call=1.0, open_for=2.0, half_open_calls=1
)
_LOG_EVERY = 30.0


def connect_redis(url: str, *, timeout: float | None, connect_timeout: float) -> Redis:
    """``timeout=None`` for a pub/sub subscriber, whose reads wait for messages."""
    return Redis.from_url(
        url,
        socket_timeout=timeout,
        socket_connect_timeout=connect_timeout,
        # The breaker decides when to try again; the client must not stall a request retrying.
        retry=Retry(NoBackoff(), 0),
        health_check_interval=0,
    )


class DegradationLog:
    """Logs a failing dependency once per interval, with how many failures it skipped."""

    def __init__(self, what: str, *, every: float = _LOG_EVERY) -> None:
        self.what = what
        self.every = every
        self.failures = 0
        self._unlogged = 0
        self._last_logged = float("-inf")

    def failed(self, exc: BaseException) -> None:
        self.failures += 1
        now = time.monotonic()
        if now - self._last_logged < self.every:
            self._unlogged += 1
            return
        log.warning(
            "%s unavailable (%s: %s); using the durable store (%d failures not logged)",
            self.what,
            type(exc).__name__,
            exc,
            self._unlogged,
        )
        self._unlogged = 0
        self._last_logged = now


class RedisCache:
    def __init__(
        self,
        redis: Redis,
        *,
        timeout: float,
        max_entry_bytes: int,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self.redis = redis
        self.timeout = timeout
        self.max_entry_bytes = max_entry_bytes
        self.breaker = CircuitBreaker("redis-cache", CACHE_BREAKER)
        self.degradation = DegradationLog("Redis cache")
        self._clock = clock

    @property
    def degraded(self) -> bool:
        return self.breaker.state is not BreakerState.CLOSED

    async def _guarded(self, call: Callable[[], Awaitable[T]]) -> T | None:
        try:
            permit = self.breaker.acquire()
        except CircuitOpen:
            return None
        try:
            async with asyncio.timeout(self.timeout):
                result = await call()
        except (RedisError, OSError, TimeoutError) as exc:
            self.breaker.record(permit, failure=True)
            self.degradation.failed(exc)
            return None
        self.breaker.record(permit, failure=False)
        return result

    async def get(self, key: RecordKey) -> CachedAnswer | None:
        raw = await self._guarded(lambda: self.redis.get(cache_key(key)))
        if not isinstance(raw, bytes):
            return None
        answer = decode(raw, key)
        if answer is None:
            self.degradation.failed(ValueError("unreadable cache entry, ignored"))
            return None
        return answer if answer.is_live(self._clock()) else None

    async def put(self, answer: CachedAnswer) -> None:
        # Never outlive the record: the entry dies when the record expires.
        ttl_ms = int((answer.expires_at - self._clock().timestamp()) * 1000)
        if ttl_ms <= 0 or len(answer.response.body) > self.max_entry_bytes:
            return
        value = encode(answer)
        await self._guarded(lambda: self.redis.set(cache_key(answer.key), value, px=ttl_ms))

    async def delete(self, key: RecordKey) -> None:
        await self._guarded(lambda: self.redis.delete(cache_key(key)))

    async def ping(self) -> bool:
        return bool(await self._guarded(self.redis.ping))

    async def close(self) -> None:
        await self.redis.aclose()
