"""``connect_redis``: the ``RedisAdapter`` a URL names, one node or a cluster.

The one place where the two part ways, and where redis-py is first imported: the in-process
cache and wake-ups, and the gateway without ``GATEWAY_REDIS_URL``, run without it installed.
"""

from __future__ import annotations

from idempotency_gateway.extras import require_redis
from idempotency_gateway.replay.redis_adapter import RedisAdapter, is_cluster_url


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
