"""What wake-ups ask of Redis pub/sub: a subscription, and on a cluster where each channel lives.

The adapters (``redis_node``, ``redis_cluster``) implement these; the wake-ups
(``wakeups``, ``cluster_wakeups``) use them and never see redis-py.
"""

from __future__ import annotations

from typing import Protocol


class Subscription(Protocol):
    """One pub/sub connection's channels (sharded ones on a cluster's primary)."""

    async def subscribe(self, *channels: str) -> None: ...

    async def unsubscribe(self, channel: str) -> None: ...

    async def next_wakeup(self, timeout: float | None) -> str | None:  # noqa: ASYNC109
        """The channel of the next wake-up message; ``None`` when ``timeout`` passed first."""
        ...

    async def close(self) -> None: ...


class Subscriber(Protocol):
    """A node to listen on, with a connection of its own: its reads block for long."""

    def subscription(self) -> Subscription: ...

    async def close(self) -> None: ...


class ClusterTopology(Protocol):
    """Which primary serves which channel, as the cluster's slot map says."""

    async def read_slot_map(self) -> None: ...

    def primary_of(self, channel: str) -> str | None:
        """``host:port`` of the primary serving ``channel``'s slot; ``None`` when none is
        known to (``RedisUnavailable`` when no known node serves the slot)."""
        ...

    def subscriber(self, primary: str) -> Subscriber: ...
