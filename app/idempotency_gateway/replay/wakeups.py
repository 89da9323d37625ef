"""Wake-ups for duplicates waiting on an in-flight owner (``Prefer: wait=N``).

A waiter parks on an event for its record key; the owner's finalize sets it. Across processes
the owner also publishes on Redis and every process that has waiters for that key subscribes
to its channel. A lost message costs only latency: after waking or timing out, the waiter
reads the durable store, which alone decides.

On a Redis Cluster the channels are sharded (SSUBSCRIBE/SPUBLISH), with one listener per
primary (``cluster_wakeups``): a wake-up is not broadcast over the cluster bus to every node as
a classic PUBLISH would be, and a dead primary delays only the wake-ups of its own keys.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING, Protocol

from idempotency_gateway.replay.cache import cache_key
from idempotency_gateway.replay.redis_unavailable import RedisUnavailable
from idempotency_gateway.storage.records import RecordKey
from idempotency_gateway.telemetry.degradation import DegradationLog

if TYPE_CHECKING:
    from idempotency_gateway.replay.redis_pubsub import Subscriber, Subscription

log = logging.getLogger(__name__)

WAKEUP_CHANNEL_PREFIX = "idgw:w:"
# Subscribed for as long as the listener runs: redis-py needs one subscription to read at all.
_KEEPALIVE_CHANNEL = WAKEUP_CHANNEL_PREFIX + "keepalive"
_RECONNECT_PAUSE = 1.0


def channel_for(key: RecordKey) -> str:
    """The pub/sub channel a key's waiters listen on; same hash tag as its cache entry."""
    return cache_key(key, prefix=WAKEUP_CHANNEL_PREFIX)


class Wakeups(Protocol):
    async def start(self) -> None:
        """Begin listening for wake-ups from other processes, if there are any to hear."""
        ...

    async def wait(self, key: RecordKey, timeout: float) -> bool: ...  # noqa: ASYNC109

    async def notify(self, key: RecordKey, *, published: bool = False) -> None:
        """Wake the key's waiters; ``published``: the replay cache already woke those in
        other processes (its put carries the wake-up), so only this process's are left."""
        ...

    async def close(self) -> None: ...


class Publisher(Protocol):
    """All the wake-ups ask of the Redis commands connection: one publish."""

    async def publish(self, channel: str) -> None: ...


class LocalWakeups:
    """Wake-ups within one process: one event per key with waiters."""

    def __init__(self) -> None:
        self._events: dict[str, asyncio.Event] = {}
        self._waiters: dict[str, int] = {}

    async def start(self) -> None:
        """Nothing to listen to: every waiter's owner runs in this process."""

    @property
    def parked(self) -> int:
        """Waiters parked right now, over every key."""
        return sum(self._waiters.values())

    async def wait(self, key: RecordKey, timeout: float) -> bool:  # noqa: ASYNC109
        channel = channel_for(key)
        event = self._events.setdefault(channel, asyncio.Event())
        self._waiters[channel] = self._waiters.get(channel, 0) + 1
        try:
            await self._first_waiter_joined(channel)
            async with asyncio.timeout(timeout):
                await event.wait()
            return True
        except TimeoutError:
            return False
        finally:
            self._waiters[channel] -= 1
            if self._waiters[channel] == 0:
                del self._waiters[channel]
                if self._events.get(channel) is event:
                    del self._events[channel]
                await self._last_waiter_left(channel)

    async def _first_waiter_joined(self, channel: str) -> None:
        """Hook for subclasses that listen elsewhere too."""

    async def _last_waiter_left(self, channel: str) -> None:
        """Hook for subclasses that listen elsewhere too."""

    def wake_local(self, channel: str) -> None:
        event = self._events.pop(channel, None)
        if event is not None:
            event.set()

    async def notify(self, key: RecordKey, *, published: bool = False) -> None:
        self.wake_local(channel_for(key))

    async def close(self) -> None:
        for event in self._events.values():
            event.set()


class PublishedWakeups(LocalWakeups):
    """Local wake-ups plus a publish on Redis for the waiters in other processes; how they
    listen is up to the subclass (one node, or a cluster's primaries)."""

    def __init__(self, *, publisher: Publisher, timeout: float) -> None:
        super().__init__()
        self.publisher = publisher
        self.timeout = timeout
        self.degradation = DegradationLog(
            "Redis wake-ups", fallback="waiters poll the durable store"
        )
        self._listener: asyncio.Task[None] | None = None

    async def notify(self, key: RecordKey, *, published: bool = False) -> None:
        channel = channel_for(key)
        self.wake_local(channel)
        if published:
            return
        try:
            async with asyncio.timeout(self.timeout):
                await self.publisher.publish(channel)
        except (RedisUnavailable, TimeoutError) as exc:
            self.degradation.failed(exc)

    async def close(self) -> None:
        await super().close()
        if self._listener is not None:
            self._listener.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._listener


class RedisWakeups(PublishedWakeups):
    """Wake-ups on one Redis node: one pub/sub connection, subscribed only to the keys this
    process waits for."""

    def __init__(self, *, publisher: Publisher, subscriber: Subscriber, timeout: float) -> None:
        super().__init__(publisher=publisher, timeout=timeout)
        # Its own connection: the subscriber's reads block for long, the publisher's are quick.
        self.subscriber = subscriber
        self._subscription: Subscription | None = None

    async def start(self) -> None:
        self._listener = asyncio.create_task(self._listen_forever())

    async def _listen_forever(self) -> None:
        while True:
            subscription = self.subscriber.subscription()
            try:
                await self._listen(subscription)
            except RedisUnavailable as exc:
                self.degradation.failed(exc)
            finally:
                self._subscription = None
                with contextlib.suppress(RedisUnavailable):
                    await subscription.close()
            await asyncio.sleep(_RECONNECT_PAUSE)

    async def _listen(self, subscription: Subscription) -> None:
        await subscription.subscribe(_KEEPALIVE_CHANNEL)
        # Channels that gained waiters while Redis was away.
        if self._waiters:
            await subscription.subscribe(*self._waiters)
        self._subscription = subscription
        while True:
            channel = await subscription.next_wakeup(timeout=1.0)
            if channel is not None:
                self.wake_local(channel)

    async def _first_waiter_joined(self, channel: str) -> None:
        if self._waiters[channel] == 1 and self._subscription is not None:
            with contextlib.suppress(RedisUnavailable):
                await self._subscription.subscribe(channel)

    async def _last_waiter_left(self, channel: str) -> None:
        if self._subscription is not None:
            with contextlib.suppress(RedisUnavailable):
                await self._subscription.unsubscribe(channel)
