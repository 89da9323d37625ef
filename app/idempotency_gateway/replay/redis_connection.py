"""Connecting to Redis: one node (``redis://``, ``rediss://``, ``unix://``) or a Redis Cluster.

A cluster URL names one or more seed nodes; the client discovers the rest and follows slot
moves and failovers itself:

    redis+cluster://[user:password@]host1:6379,host2:6379[/]
    rediss+cluster://...          the same over TLS

A cluster has no database numbers, so the path must be empty (or ``/0``). redis-py has no
URL form for a cluster (its ``RedisCluster.from_url`` takes one node), hence this one.
"""

from __future__ import annotations

from urllib.parse import unquote

from redis.asyncio import Redis, RedisCluster
from redis.asyncio.cluster import ClusterNode
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

RedisClient = Redis | RedisCluster

_CLUSTER_SCHEMES = {"redis+cluster": False, "rediss+cluster": True}


def is_cluster_url(url: str) -> bool:
    return url.partition("://")[0].lower() in _CLUSTER_SCHEMES


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


def connect_redis(url: str, *, timeout: float | None, connect_timeout: float) -> RedisClient:
    """``timeout=None`` for a pub/sub subscriber, whose reads wait for messages. (The
    ``hiredis`` extra makes redis-py parse replies in C: about a sixth more new keys per
    second through a worker.)"""
    # The breaker decides when to try again; the client must not stall a request retrying.
    no_retry = Retry(NoBackoff(), 0)
    if not is_cluster_url(url):
        return Redis.from_url(
            url,
            socket_timeout=timeout,
            socket_connect_timeout=connect_timeout,
            retry=no_retry,
            health_check_interval=0,
        )
    seeds, username, password = cluster_seeds(url)
    return RedisCluster(
        startup_nodes=seeds,
        username=username,
        password=password,
        ssl=_CLUSTER_SCHEMES[url.partition("://")[0].lower()],
        socket_timeout=timeout,
        socket_connect_timeout=connect_timeout,
        # No retries here either (they would re-read the topology on the request's time):
        # the next request after a failure finds the moved slot or the restarted node.
        retry=no_retry,
        # One dead primary must cost only its own slots, not every key.
        require_full_coverage=False,
    )
