"""Connecting to Redis with redis-py, and where its failures become ``RedisUnavailable``.

One node (``redis://``, ``rediss://``, ``unix://``) or a Redis Cluster. A cluster URL names
one or more seed nodes; the client discovers the rest and follows slot moves and failovers
itself:

    redis+cluster://[user:password@]host1:6379,host2:6379[/]
    rediss+cluster://...          the same over TLS

A cluster has no database numbers, so the path must be empty (or ``/0``). redis-py has no
URL form for a cluster (its ``RedisCluster.from_url`` takes one node), hence this one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from urllib.parse import unquote

from redis.asyncio import ConnectionPool, Redis, RedisCluster
from redis.asyncio.client import PubSub
from redis.asyncio.cluster import ClusterNode
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisClusterException, RedisError

from idempotency_gateway.replay.redis_adapter import uses_tls
from idempotency_gateway.replay.redis_unavailable import RedisUnavailable

# What a Redis call raises when Redis is down, slow, refusing or killed mid-call: redis-py's
# own errors (``RedisClusterException`` is not a ``RedisError``: a slot no live node covers),
# and the socket's, which redis-py does not always wrap.
REDIS_FAILURES: tuple[type[Exception], ...] = (
    RedisError,
    RedisClusterException,
    ConnectionError,
    TimeoutError,
    OSError,
)
# What redis-py's internals raise when a connection is torn down under a command, found by
# fault runs, each a client's answer cut short before it was caught: uvloop's RuntimeError
# ("the handler is closed") under a reconnect's HELLO, and an AttributeError on the writer a
# concurrent reconnect of a cluster node dropped. Only caught around a call into redis-py:
# the same errors raised by the gateway's own code are bugs, and propagate.
TORN_CONNECTION: tuple[type[Exception], ...] = (RuntimeError, AttributeError)
# Both, for the callers that use redis-py's clients directly (the live streams).
FAILED_CALL: tuple[type[Exception], ...] = (*REDIS_FAILURES, *TORN_CONNECTION)


@contextlib.contextmanager
def redis_failures() -> Iterator[None]:
    """Around every call into redis-py: Redis failing becomes ``RedisUnavailable``."""
    try:
        yield
    except FAILED_CALL as exc:
        raise RedisUnavailable(f"{type(exc).__name__}: {exc}") from exc


def cluster_seeds(url: str) -> tuple[list[ClusterNode], str | None, str | None]:
    """The seed nodes, username and password of a ``redis+cluster://`` URL."""
    _, _, rest = url.partition("://")
    location, _, path = rest.partition("/")
    location = location.split("?", 1)[0]
    if path.split("?", 1)[0] not in ("", "0"):
        raise ValueError(f"a Redis Cluster has only database 0, not {path!r}")
    userinfo, _, hosts = location.rpartition("@")
    username, _, password = userinfo.partition(":")
    seeds = []
    for address in hosts.split(","):
        host, _, port = address.strip().rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"a cluster seed must be host:port, not {address!r}")
        seeds.append(ClusterNode(host.strip("[]"), int(port)))
    return seeds, unquote(username) or None, unquote(password) or None


def _no_retry() -> Retry:
    # The breaker decides when to try again; the client must not stall a request retrying.
    return Retry(NoBackoff(), 0)


def node_client(url: str, *, timeout: float | None, connect_timeout: float) -> Redis:
    """``timeout=None`` for a pub/sub subscriber, whose reads wait for messages. (The
    ``hiredis`` extra makes redis-py parse replies in C: about a sixth more new keys per
    second through a worker.)"""
    return Redis.from_url(
        url,
        socket_timeout=timeout,
        socket_connect_timeout=connect_timeout,
        retry=_no_retry(),
        health_check_interval=0,
    )


def cluster_client(url: str, *, timeout: float | None, connect_timeout: float) -> RedisCluster:
    seeds, username, password = cluster_seeds(url)
    return RedisCluster(
        startup_nodes=seeds,
        username=username,
        password=password,
        ssl=uses_tls(url),
        socket_timeout=timeout,
        socket_connect_timeout=connect_timeout,
        # No retries here either (they would re-read the topology on the request's time):
        # the next request after a failure finds the moved slot or the restarted node.
        retry=_no_retry(),
        # One dead primary must cost only its own slots, not every key.
        require_full_coverage=False,
    )


class PubSubSubscription:
    """Channels on one pub/sub connection: classic ones on a single node, sharded ones
    (SSUBSCRIBE) on a cluster's primary."""

    def __init__(self, pubsub: PubSub, *, sharded: bool) -> None:
        self._pubsub = pubsub
        self._sharded = sharded

    async def subscribe(self, *channels: str) -> None:
        with redis_failures():
            if not self._sharded:
                await self._pubsub.subscribe(*channels)
                return
            # Each channel alone: a node rejects an SSUBSCRIBE whose channels span slots.
            for channel in channels:
                await self._pubsub.ssubscribe(channel)

    async def unsubscribe(self, channel: str) -> None:
        with redis_failures():
            if self._sharded:
                await self._pubsub.sunsubscribe(channel)
            else:
                await self._pubsub.unsubscribe(channel)

    async def next_wakeup(self, timeout: float | None) -> str | None:  # noqa: ASYNC109
        with redis_failures():
            message = await self._pubsub.get_message(timeout=timeout)
        if message is None or message["type"] not in ("message", "smessage", b"smessage"):
            return None
        return str(message["channel"].decode())

    async def close(self) -> None:
        with redis_failures():
            await self._pubsub.aclose()  # type: ignore[no-untyped-call]


class NodeSubscriber:
    """One node's pub/sub side, on a client of its own (no read timeout)."""

    def __init__(self, client: Redis, *, sharded: bool) -> None:
        self._client = client
        self._sharded = sharded

    @classmethod
    def of(cls, node: ClusterNode) -> NodeSubscriber:
        """A cluster primary, connected as the cluster client connects to it."""
        pool = ConnectionPool(connection_class=node.connection_class, **node.connection_kwargs)
        return cls(Redis(connection_pool=pool), sharded=True)

    def subscription(self) -> PubSubSubscription:
        pubsub = self._client.pubsub(ignore_subscribe_messages=True)
        return PubSubSubscription(pubsub, sharded=self._sharded)

    async def close(self) -> None:
        with redis_failures():
            await self._client.aclose()
