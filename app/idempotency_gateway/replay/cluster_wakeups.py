"""Wake-ups on a Redis Cluster: one listener per primary, so a dead primary costs only its own.

A key's wake-up channel shares its cache entry's hash tag, so it lives on the primary that
serves the key's slot: the owner's SET and SPUBLISH are one round trip to that node, and a
waiter SSUBSCRIBEs there. Each primary that serves a channel this process waits on gets a
``PrimaryListener`` of its own: one task, one pub/sub connection to that node, subscribed to
exactly the channels of the slots it serves. A primary that dies or cannot be reached breaks
only its own listener, so only the waiters for keys it serves lose their wake-ups (they wait
out ``Prefer: wait`` and then read the store, which alone decides); waiters for keys on every
live primary keep waking at once.

A broken listener is rebuilt with full-jitter exponential backoff (``_BACKOFF_BASE`` up to
``_BACKOFF_CAP``), after the slot map is read again, so channels whose slots moved (a
failover, a resharding) follow them to their new primary. An idle listener blocks on its
socket: a gateway with no waiters costs no CPU on a cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Awaitable
from typing import TYPE_CHECKING

from idempotency_gateway.replay.redis_unavailable import RedisUnavailable
from idempotency_gateway.replay.wakeups import PublishedWakeups, Publisher
from idempotency_gateway.resilience.backoff import full_jitter

if TYPE_CHECKING:
    from idempotency_gateway.replay.redis_pubsub import ClusterTopology, Subscription

# The first rebuild of a broken listener comes within a tenth of a second (a blip costs
# little); a primary that stays dead is asked at most every few seconds.
_BACKOFF_BASE = 0.1
_BACKOFF_CAP = 5.0
# Reading the slot map asks the seed nodes in turn; no request waits on it, so it may take
# far longer than a cache call.
_SLOT_MAP_TIMEOUT = 5.0


def _backoff(failures: int) -> float:
    return full_jitter(failures, base=_BACKOFF_BASE, cap=_BACKOFF_CAP)


class PrimaryListener:
    """The wake-up channels one primary serves, on a connection of their own."""

    def __init__(self, name: str, wakeups: ClusterWakeups) -> None:
        self.name = name
        self.channels: set[str] = set()
        self.failures = 0
        self._wakeups = wakeups
        self._subscriber = wakeups.topology.subscriber(name)
        self._subscription: Subscription | None = None
        self._changed = asyncio.Event()
        self._task = asyncio.create_task(self._listen_forever())

    async def add(self, channel: str) -> None:
        self.channels.add(channel)
        self._changed.set()
        # Not connected yet, or broken: the (re)build subscribes to what ``channels`` holds.
        if self._subscription is not None:
            await self._quietly(self._subscription.subscribe(channel))

    async def remove(self, channel: str) -> None:
        self.channels.discard(channel)
        if self._subscription is not None:
            await self._quietly(self._subscription.unsubscribe(channel))

    async def _quietly(self, command: Awaitable[object]) -> None:
        """A failed command breaks the listener's read too, which rebuilds it. (No timeout:
        the command is only written, its reply comes to the reader, and cutting a write short
        would leave the connection mid-command.)"""
        with contextlib.suppress(RedisUnavailable):
            await command

    async def _listen_forever(self) -> None:
        while True:
            try:
                await self._listen()
            except RedisUnavailable as exc:
                self._wakeups.degradation.failed(exc)
            self.failures += 1
            await asyncio.sleep(_backoff(self.failures - 1))
            # Its slots may have moved to another primary while it was away.
            await self._wakeups.rehome(self)

    async def _listen(self) -> None:
        while not self.channels:
            self._changed.clear()
            await self._changed.wait()
        subscription = self._subscriber.subscription()
        try:
            subscribed: set[str] = set()
            # Channels that gained waiters while an SSUBSCRIBE was on its way go in the next
            # one; no await between the last check and publishing ``_subscription``, after
            # which ``add`` subscribes by itself.
            while missing := self.channels - subscribed:
                subscribed |= missing
                await subscription.subscribe(*missing)
            self._subscription = subscription
            self.failures = 0
            while True:
                channel = await subscription.next_wakeup(timeout=None)
                if channel is not None:
                    self._wakeups.wake_local(channel)
        finally:
            self._subscription = None
            with contextlib.suppress(RedisUnavailable):
                await subscription.close()

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        with contextlib.suppress(RedisUnavailable):
            await self._subscriber.close()


class ClusterWakeups(PublishedWakeups):
    """Wake-ups on a cluster: sharded channels, a listener per primary."""

    def __init__(self, *, publisher: Publisher, topology: ClusterTopology, timeout: float) -> None:
        super().__init__(publisher=publisher, timeout=timeout)
        self.topology = topology
        self.listeners: dict[str, PrimaryListener] = {}
        # Channels with waiters that no listener holds: the slot map is not known yet.
        self._unrouted: set[str] = set()
        self._mapped = False

    async def start(self) -> None:
        self._listener = asyncio.create_task(self._read_slot_map())

    async def _read_slot_map(self) -> None:
        for attempt in itertools.count():
            if await self._refresh_slot_map():
                break
            await asyncio.sleep(_backoff(attempt))
        self._mapped = True
        unrouted, self._unrouted = self._unrouted, set()
        for channel in unrouted:
            await self._route(channel)

    async def _refresh_slot_map(self) -> bool:
        try:
            async with asyncio.timeout(_SLOT_MAP_TIMEOUT):
                await self.topology.read_slot_map()
        except (RedisUnavailable, TimeoutError) as exc:
            self.degradation.failed(exc)
            return False
        return True

    async def _route(self, channel: str) -> None:
        if not self._mapped:
            self._unrouted.add(channel)
            return
        name = self._node_of(channel)
        if name is None:
            return
        listener = self.listeners.get(name)
        if listener is None:
            listener = self.listeners[name] = PrimaryListener(name, self)
        await listener.add(channel)

    def _node_of(self, channel: str) -> str | None:
        """The primary serving ``channel``'s slot by the slot map, if any does."""
        try:
            return self.topology.primary_of(channel)
        except RedisUnavailable as exc:  # a slot no known node serves: its waiters poll
            self.degradation.failed(exc)
            return None

    async def rehome(self, listener: PrimaryListener) -> None:
        """After ``listener`` broke: move its channels whose slots another primary serves now."""
        if not listener.channels or not await self._refresh_slot_map():
            return
        for channel in list(listener.channels):
            if self._node_of(channel) not in (None, listener.name):
                listener.channels.discard(channel)
                await self._route(channel)

    async def _first_waiter_joined(self, channel: str) -> None:
        if self._waiters[channel] == 1:
            await self._route(channel)

    async def _last_waiter_left(self, channel: str) -> None:
        self._unrouted.discard(channel)
        for listener in self.listeners.values():
            if channel in listener.channels:
                await listener.remove(channel)

    async def close(self) -> None:
        await super().close()
        for listener in self.listeners.values():
            await listener.close()
