"""``RedisAdapter`` on a single Redis node.

A replay's GET and an answer's SET (the script ``SET_UNLESS_INVALIDATED``) + PUBLISH go on
connections of the client's own pool, past redis-py's per-call layers (``redis_direct``),
each loop iteration's together in one pipeline; everything else through the client.
Wake-ups listen on one pub/sub connection of a client of their own, whose reads block, and
live streams' followers read on another (``redis_commands``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from redis.asyncio import Redis

from idempotency_gateway.replay.redis_adapter import INVALIDATED, SET_UNLESS_INVALIDATED
from idempotency_gateway.replay.redis_commands import CommandClient
from idempotency_gateway.replay.redis_connection import NodeSubscriber, node_client, redis_failures
from idempotency_gateway.replay.redis_direct import DirectCommands
from idempotency_gateway.replay.wakeups import RedisWakeups


class NodeRedis(CommandClient):
    """``direct``: the client whose pool the GET and SET + PUBLISH take connections from.
    It has no socket timeout: redis-py would wrap every write in a task of ``wait_for`` and
    every read in a timeout of its own, each judged on the loop's clock, while the cache
    already bounds each of these calls with its own deadline (``redis_deadline``). ``reader``
    is another without one, for live streams' blocking reads, kept apart so that followers
    never take the connections a replay needs."""

    def __init__(self, commands: Redis, subscriber: Redis, reader: Redis, direct: Redis) -> None:
        super().__init__(commands, reader)
        self._client: Redis = commands
        self._direct_client = direct
        self._direct = DirectCommands(direct)
        self._subscriber = NodeSubscriber(subscriber, sharded=False)

    @classmethod
    def from_url(cls, url: str, *, timeout: float | None, connect_timeout: float) -> NodeRedis:
        return cls(
            node_client(url, timeout=timeout, connect_timeout=connect_timeout),
            node_client(url, timeout=None, connect_timeout=connect_timeout),
            node_client(url, timeout=None, connect_timeout=connect_timeout),
            node_client(url, timeout=None, connect_timeout=connect_timeout),
        )

    async def get(self, name: str) -> object:
        with redis_failures():
            return (await self._direct.run_batched(("GET", name)))[0]

    async def get_with_ttl(self, name: str) -> tuple[object, object]:
        with redis_failures():
            value, ttl_ms = await self._direct.run_batched(("GET", name), ("PTTL", name))
        return value, ttl_ms

    async def set_and_publish(self, name: str, value: bytes, *, ttl_ms: int, channel: str) -> None:
        with redis_failures():
            await self._direct.run_batched(
                ("EVAL", SET_UNLESS_INVALIDATED, 1, name, value, ttl_ms, INVALIDATED),
                ("PUBLISH", channel, b"1"),
            )

    async def publish(self, channel: str) -> None:
        with redis_failures():
            await self._client.publish(channel, b"1")

    async def health(self, *, ping: Callable[[], Awaitable[bool]], ping_timeout: float) -> str:
        # One node: the cache's own PING, so readiness agrees with what requests see.
        return "ok" if await ping() else "degraded"

    def wakeups(self, *, timeout: float) -> RedisWakeups:
        return RedisWakeups(publisher=self, subscriber=self._subscriber, timeout=timeout)

    async def close(self) -> None:
        await self._direct.close()
        with redis_failures():
            await self._direct_client.aclose()
            await self._client.aclose()
        await self._subscriber.close()
        await self.close_reader()
