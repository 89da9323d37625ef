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

from idempotency_gateway.replay.redis_cache import (
    REDIS_FAILURES,
    WAKEUP_CHANNEL_PREFIX,
    wakeup_channel,
)
from idempotency_gateway.storage.records import RecordKey
from idempotency_gateway.telemetry.degradation import DegradationLog

if TYPE_CHECKING:
    from redis.asyncio.client import PubSub

    from idempotency_gateway.replay.redis_connection import RedisClient

log = logging.getLogger(__name__)

# Subscribed for as long as the listener runs: redis-py needs one subscription to read at all.
_KEEPALIVE_CHANNEL = WAKEUP_CHANNEL_PREFIX + "keepalive"
_RECONNECT_PAUSE = 1.0
channel_for = wakeup_channel


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


class RedisWakeups(LocalWakeups):
    """Local wake-ups plus Redis pub/sub on one node, subscribing only to keys this process
    waits for."""

    def __init__(self, *, subscriber: RedisClient, publisher: RedisClient, timeout: float) -> None:
        super().__init__()
        # Two clients: the subscriber's reads block for long, the publisher's must be quick.
        self.redis = subscriber
        self.publisher = publisher
        self.timeout = timeout
        self.degradation = DegradationLog(
            "Redis wake-ups", fallback="waiters poll the durable store"
        )
        self._pubsub: PubSub | None = None
        self._listener: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._listener = asyncio.create_task(self._listen_forever())

    async def _listen_forever(self) -> None:
        while True:
            pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
            try:
                await self._listen(pubsub)
            except REDIS_FAILURES as exc:
                self.degradation.failed(exc)
            finally:
                self._pubsub = None
                with contextlib.suppress(*REDIS_FAILURES):
                    await pubsub.aclose()  # type: ignore[no-untyped-call]
            await asyncio.sleep(_RECONNECT_PAUSE)

    async def _listen(self, pubsub: PubSub) -> None:
        await pubsub.subscribe(_KEEPALIVE_CHANNEL)
        # Channels that gained waiters while Redis was away.
        if self._waiters:
            await pubsub.subscribe(*self._waiters)
        self._pubsub = pubsub
        while True:
            message = await pubsub.get_message(timeout=1.0)
            if message is not None and message["type"] == "message":
                self.wake_local(message["channel"].decode())

    async def _first_waiter_joined(self, channel: str) -> None:
        if self._waiters[channel] == 1 and self._pubsub is not None:
            with contextlib.suppress(*REDIS_FAILURES):
                await self._pubsub.subscribe(channel)

    async def _last_waiter_left(self, channel: str) -> None:
        if self._pubsub is not None:
            with contextlib.suppress(*REDIS_FAILURES):
                await self._pubsub.unsubscribe(channel)

    async def notify(self, key: RecordKey, *, published: bool = False) -> None:
        channel = channel_for(key)
        self.wake_local(channel)
        if published:
            return
        try:
            async with asyncio.timeout(self.timeout):
                await self._publish(channel)
        except REDIS_FAILURES as exc:
            self.degradation.failed(exc)

    async def _publish(self, channel: str) -> None:
        await self.publisher.publish(channel, b"1")

    async def close(self) -> None:
        await super().close()
        if self._listener is not None:
            self._listener.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._listener
