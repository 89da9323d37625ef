"""The Redis ``ReplayCache``, built to fail soft, on one node or a Redis Cluster.

Redis down, slow or answering garbage must never surface to a client: every call has a
timeout in milliseconds, every failure is a miss, and a small circuit breaker stops asking a
dead Redis on every request (half-open probes find it again when it returns). Failures are
logged at most once per interval, with the number that were not logged.

Round trips: a replay is one GET; storing an answer is one pipelined SET + PUBLISH (the SET
a script that refuses to overwrite an operator's delete, ``redis_adapter.INVALIDATED``), which
also wakes ``Prefer: wait`` waiters in other processes (see ``wakeups``). On a cluster the
wake-up is a sharded SPUBLISH: the key's entry and its channel share a hash tag, so both
commands go to the one node that owns the key, in one round trip.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import TypeVar

from idempotency_gateway.clock import Monotonic, lease_clock
from idempotency_gateway.config import BreakerConfig
from idempotency_gateway.errors import CircuitOpen
from idempotency_gateway.replay.cache import (
    INVALIDATION_GUARD,
    CachedAnswer,
    cache_key,
    cache_lookups,
    decode,
    encode,
)
from idempotency_gateway.replay.redis_adapter import INVALIDATED, RedisAdapter
from idempotency_gateway.replay.redis_deadline import RedisDeadline
from idempotency_gateway.replay.redis_unavailable import RedisUnavailable
from idempotency_gateway.replay.wakeups import channel_for
from idempotency_gateway.resilience.breaker import BreakerState, CircuitBreaker
from idempotency_gateway.storage.records import RecordKey
from idempotency_gateway.telemetry import tracing
from idempotency_gateway.telemetry.degradation import DegradationLog
from idempotency_gateway.telemetry.iteration_metrics import observations
from idempotency_gateway.telemetry.metrics import CACHE_LATENCY

log = logging.getLogger(__name__)

T = TypeVar("T")

# Open after half of at least five calls failed in ten seconds; probe again after two.
CACHE_BREAKER = BreakerConfig(
    window=10.0, min_calls=5, failure_rate=0.5, slow_call=1.0, open_for=2.0, half_open_calls=1
)

# An operator's delete keeps answers out of Redis as long as out of each process's copies.
_GUARD_MS = int(INVALIDATION_GUARD * 1000)

_cache_latency = observations(CACHE_LATENCY)


class _Failed:
    """The result of a Redis call that did not happen or did not answer."""


FAILED = _Failed()


class RedisCache:
    shared_across_workers = True

    def __init__(
        self,
        redis: RedisAdapter,
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

    @property
    def degraded(self) -> bool:
        return self.breaker.state is not BreakerState.CLOSED

    async def _guarded(self, operation: str, call: Callable[[], Awaitable[T]]) -> T | _Failed:
        """Run one Redis call under the breaker and a deadline; a failure is a value, never an
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
        deadline = RedisDeadline(self.timeout)
        try:
            result = await call()
            succeeded = True
        except asyncio.CancelledError:
            if not deadline.expired():
                raise
            return self._failed(TimeoutError("Redis did not answer in time"), span)
        # Redis failing is a miss, never a 500; any other exception is a bug, and is raised.
        except RedisUnavailable as exc:
            return self._failed(exc, span)
        finally:
            deadline.cancel()
            _cache_latency(operation).observe(time.perf_counter() - started)
            # Every admitted call reports, cancelled ones too: a half-open probe that never
            # reported would hold the breaker's only permit and refuse Redis for good. A
            # cancelled call counts as failed because nothing proved Redis healthy.
            self.breaker.record(permit, failure=not succeeded)
            if span is not None:
                span.end()
        return result

    def _failed(self, exc: Exception, span: tracing.Span | None) -> _Failed:
        self.degradation.failed(exc)
        if span is not None:
            span.fail(exc)
        return FAILED

    async def get(self, key: RecordKey) -> CachedAnswer | None:
        raw = await self._guarded("get", lambda: self.redis.get(cache_key(key)))
        # Redis's own TTL had the entry live when it answered, and it is served at once.
        return self._answer(key, raw, expires_at=self._monotonic())

    async def get_with_expiry(self, key: RecordKey) -> CachedAnswer | None:
        """The entry with the life Redis had left for it, for a copy kept after this request
        (``TieredCache``): one round trip, GET and PTTL together."""
        asked_at = self._monotonic()
        reply = await self._guarded("get", lambda: self.redis.get_with_ttl(cache_key(key)))
        if isinstance(reply, _Failed):
            return self._answer(key, reply, expires_at=asked_at)
        raw, ttl_ms = reply
        # PTTL answers -1 (no TTL) or -2 (gone) in its own right: never a copy to keep alive.
        life = ttl_ms / 1000 if isinstance(ttl_ms, int) and ttl_ms > 0 else 0.0
        # Counted from before the GET was sent: the copy dies no later than Redis's entry.
        return self._answer(key, raw, expires_at=asked_at + life)

    def _answer(self, key: RecordKey, raw: object, *, expires_at: float) -> CachedAnswer | None:
        if raw is FAILED:
            cache_lookups("error").inc()
            return None
        if raw == INVALIDATED:
            cache_lookups("miss").inc()
            return None
        answer = decode(raw, key, expires_at=expires_at) if isinstance(raw, bytes) else None
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
            "put",
            lambda: self.redis.set_and_publish(
                cache_key(answer.key), value, ttl_ms=ttl_ms, channel=channel_for(answer.key)
            ),
        )
        return stored is not FAILED

    async def delete(self, key: RecordKey) -> bool:
        """Replace the entry with the marker that keeps answers out for
        ``INVALIDATION_GUARD``. False when Redis could not be asked: the caller decides
        whether that matters."""
        name = cache_key(key)
        invalidate = self.redis.invalidate
        marked = await self._guarded("delete", lambda: invalidate(name, ttl_ms=_GUARD_MS))
        return marked is not FAILED

    def invalidate(self, keys: Iterable[RecordKey]) -> None:
        """Nothing to drop: every process reads the one copy in Redis, which the admin API
        deletes itself."""

    def clear(self) -> None:
        """Nothing to drop: this process keeps no copies of its own."""

    async def ping(self) -> bool:
        return await self._guarded("ping", self.redis.ping) is True

    async def health(self) -> str:
        """``ok``, or ``degraded`` saying what does not answer (on a cluster, each primary)."""
        return await self.redis.health(ping=self.ping, ping_timeout=self.timeout)

    async def close(self) -> None:
        await self.redis.close()
