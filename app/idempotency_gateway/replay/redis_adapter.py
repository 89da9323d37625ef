"""``RedisAdapter``: all the cache and the wake-ups ask of Redis, on one node or a cluster.

``connect_redis`` builds it once from the URL, and that is the only place where one node and
a cluster part ways: a single node (``redis_node``) sends its GET and SET + PUBLISH past
redis-py's per-call layers and listens on one pub/sub connection; a cluster
(``redis_cluster``) routes by slot, publishes on sharded channels and listens on one
connection per primary. Neither the cache nor the wake-ups look at a client's type.

Errors translate once, at the adapter's edge (``redis_connection.redis_failures``): what
means "Redis failed" (redis-py's errors, socket errors, timeouts, a connection torn down under
a command) leaves it as ``RedisUnavailable``, which callers turn into a miss; anything else is
a bug and is raised as it is.

redis-py is imported only when an adapter is built: the in-process cache and wake-ups, and
the gateway without ``GATEWAY_REDIS_URL``, run without it installed.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Protocol

from idempotency_gateway.extras import require_redis

if TYPE_CHECKING:
    from idempotency_gateway.replay.wakeups import PublishedWakeups

_CLUSTER_SCHEMES = {"redis+cluster": False, "rediss+cluster": True}


class RedisUnavailable(Exception):
    """Redis is down, slow, refusing, or dropped a connection under a command. Redis never
    decides, so this never reaches a client: a cache miss, a wake-up left to the store."""


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


class RedisAdapter(Protocol):
    async def get(self, name: str) -> object:
        """The value as Redis sent it: ``bytes``, or ``None`` when there is none."""
        ...

    async def get_with_ttl(self, name: str) -> tuple[object, object]:
        """The value and its remaining life in milliseconds (PTTL), in one round trip."""
        ...

    async def set_and_publish(self, name: str, value: bytes, *, ttl_ms: int, channel: str) -> None:
        """SET with a TTL and a wake-up on ``channel``, in one round trip."""
        ...

    async def publish(self, channel: str) -> None: ...

    async def delete(self, name: str) -> None: ...

    async def ping(self) -> bool: ...

    async def health(self, *, ping: Callable[[], Awaitable[bool]], ping_timeout: float) -> str:
        """What readiness reports: ``ping`` is the cache's own, under its breaker."""
        ...

    def wakeups(self, *, timeout: float) -> PublishedWakeups:
        """Wake-ups across processes, listening the way this deployment needs."""
        ...

    async def close(self) -> None: ...


def is_cluster_url(url: str) -> bool:
    return url.partition("://")[0].lower() in _CLUSTER_SCHEMES


def uses_tls(cluster_url: str) -> bool:
    return _CLUSTER_SCHEMES[cluster_url.partition("://")[0].lower()]


def connect_redis(url: str, *, timeout: float | None, connect_timeout: float) -> RedisAdapter:
    """The adapter for ``url`` (``redis://``, ``rediss://``, ``unix://``, or
    ``redis+cluster://`` / ``rediss+cluster://``, see ``redis_connection``). ``timeout`` bounds
    each command's socket reads (``None``: none); pub/sub connections never have one."""
    # Imported here: building an adapter is what needs redis-py.
    require_redis()
    if is_cluster_url(url):
        from idempotency_gateway.replay.redis_cluster import ClusterRedis

        return ClusterRedis.from_url(url, timeout=timeout, connect_timeout=connect_timeout)
    from idempotency_gateway.replay.redis_node import NodeRedis

    return NodeRedis.from_url(url, timeout=timeout, connect_timeout=connect_timeout)
