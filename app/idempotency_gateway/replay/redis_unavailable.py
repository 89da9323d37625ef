"""``RedisUnavailable``: what every Redis failure becomes at the adapter's edge.

A module of its own, below everything that talks to Redis: the adapters raise it
(``redis_connection.redis_failures``), and the cache, wake-ups and live streams catch it.
"""


class RedisUnavailable(Exception):
    """Redis is down, slow, refusing, or dropped a connection under a command. Redis never
    decides, so this never reaches a client: a cache miss, a wake-up left to the store."""
