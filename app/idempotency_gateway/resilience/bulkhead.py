"""``Bulkhead``: a concurrency limit with a bounded FIFO wait queue and a queue timeout.

The bulkhead pattern (resilience4j's semaphore bulkhead, Envoy's per-cluster ``max_requests``
and ``max_pending_requests``): at most ``max_concurrent`` holders at once, up to
``max_queued`` more waiting in arrival order, each for at most ``queue_timeout``; anything
beyond is refused at once with ``CapacityExhausted``. A refusal is cheap and early, so a
slow route fills its own bulkhead and no one else's, and its excess learns "not now" in
microseconds instead of at its deadline.

A free slot costs a comparison and an increment: no lock, no task, no timer, no metric
write (asyncio runs one callback at a time, so the counter needs no lock). Only a request
that has to wait creates a future, and a release hands its slot straight to the oldest
waiter, so a newcomer can never overtake the queue. The in-flight and queued gauges are
sampled (``publish_every``) rather than written per request: with several workers each
gauge write is a write to a shared file, which would cost more than the bulkhead itself.

Each worker process has its own bulkheads; the limits are per worker.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Iterable
from enum import StrEnum

from idempotency_gateway.config import BulkheadConfig
from idempotency_gateway.errors import CapacityExhausted
from idempotency_gateway.telemetry.metrics import (
    BULKHEAD_IN_FLIGHT,
    BULKHEAD_LIMIT,
    BULKHEAD_QUEUE_WAIT,
    BULKHEAD_QUEUED,
    BULKHEAD_REFUSALS,
)

# How often the in-flight and queued gauges are sampled; scrapes come every 15 s or more.
SAMPLE_EVERY = 1.0


class BulkheadKind(StrEnum):
    TIER = "tier"
    UPSTREAM = "upstream"


class Refusal(StrEnum):
    """Why a bulkhead said no: the ``reason`` label of the refusals metric."""

    QUEUE_FULL = "queue_full"
    QUEUE_TIMEOUT = "queue_timeout"
    RETRY_NO_SLOT = "retry_no_slot"


class Bulkhead:
    """``await acquire()`` takes a slot (waiting in the queue if it must) or raises
    ``CapacityExhausted``; ``release()`` gives it back; ``try_acquire()`` takes a free slot
    only, never waiting and never ahead of the queue (for retries).

    Arguments:
        kind: a route tier or an upstream, for metrics and the refusal's detail.
        name: the tier's or the upstream's name.
        config: the limits.
    """

    def __init__(self, kind: BulkheadKind, name: str, config: BulkheadConfig) -> None:
        self.kind = kind
        self.name = name
        self.max_concurrent = config.max_concurrent
        self.max_queued = config.max_queued
        self.queue_timeout = config.queue_timeout
        self.in_flight = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        labels = (kind.value, name)
        self._in_flight = BULKHEAD_IN_FLIGHT.labels(*labels)
        self._queued = BULKHEAD_QUEUED.labels(*labels)
        self._queue_wait = BULKHEAD_QUEUE_WAIT.labels(*labels)
        self._refusals = {
            reason: BULKHEAD_REFUSALS.labels(*labels, reason.value) for reason in Refusal
        }
        BULKHEAD_LIMIT.labels(*labels).set(config.max_concurrent)

    @property
    def queued(self) -> int:
        return len(self._waiters)

    async def acquire(self) -> None:
        if self.in_flight < self.max_concurrent and not self._waiters:
            self.in_flight += 1
            return
        await self._wait_for_slot()

    def try_acquire(self) -> bool:
        if self.in_flight < self.max_concurrent and not self._waiters:
            self.in_flight += 1
            return True
        self._refusals[Refusal.RETRY_NO_SLOT].inc()
        return False

    def release(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            # A waiter cancelled (timed out) a moment ago leaves the queue on its own.
            if not waiter.done():
                # The slot passes to the oldest waiter as it is: in_flight does not change.
                waiter.set_result(None)
                return
        self.in_flight -= 1

    def publish(self) -> None:
        """Set the in-flight and queued gauges to what they are now."""
        self._in_flight.set(self.in_flight)
        self._queued.set(len(self._waiters))

    async def _wait_for_slot(self) -> None:
        if len(self._waiters) >= self.max_queued:
            raise self._refuse(Refusal.QUEUE_FULL)
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        started = time.perf_counter()
        try:
            async with asyncio.timeout(self.queue_timeout):
                await waiter
        except BaseException as error:
            if waiter.done() and not waiter.cancelled():
                # The slot arrived in the same instant as the timeout or the cancellation:
                # hand it on rather than lose it.
                self.release()
            elif waiter in self._waiters:
                self._waiters.remove(waiter)
            self._queue_wait.observe(time.perf_counter() - started)
            if isinstance(error, TimeoutError):
                raise self._refuse(Refusal.QUEUE_TIMEOUT) from None
            raise
        self._queue_wait.observe(time.perf_counter() - started)

    def _refuse(self, reason: Refusal) -> CapacityExhausted:
        self._refusals[reason].inc()
        waited = f" after waiting {self.queue_timeout}s" if reason is Refusal.QUEUE_TIMEOUT else ""
        return CapacityExhausted(
            f"the {self.kind.value} {self.name!r} is at capacity ({self.max_concurrent} "
            f"in flight, {self.max_queued} queued){waited}; nothing was sent, retry later"
        )


async def publish_every(bulkheads: Iterable[Bulkhead], every: float = SAMPLE_EVERY) -> None:
    """Sample every bulkhead's gauges every ``every`` seconds, until cancelled."""
    while True:
        for bulkhead in bulkheads:
            bulkhead.publish()
        await asyncio.sleep(every)


class RetrySlot:
    """The one extra slot of the upstream's bulkhead that a request's retries hold, from its
    first retry until its attempts end (Envoy's ``max_retries``, counted in the same limit):
    taken only when free at once, so a full upstream gets no retries and a brownout is not
    amplified. With no bulkhead every retry may go. ``give_back`` ends it, once or more."""

    __slots__ = ("_bulkhead", "_held")

    def __init__(self, bulkhead: Bulkhead | None) -> None:
        self._bulkhead = bulkhead
        self._held = False

    def take(self) -> bool:
        if self._held or self._bulkhead is None:
            return True
        self._held = self._bulkhead.try_acquire()
        return self._held

    def give_back(self) -> None:
        if self._held and self._bulkhead is not None:
            self._held = False
            self._bulkhead.release()
