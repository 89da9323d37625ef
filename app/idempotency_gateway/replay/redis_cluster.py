"""``RedisAdapter`` on a Redis Cluster.

Commands go through redis-py's cluster client, which routes each by slot. A key's entry and
its wake-up channel share a hash tag (``cache.cache_key``), so an answer's SET and its
sharded SPUBLISH go to the one primary that owns the key, pipelined in one round trip.
Wake-ups listen per primary (``cluster_wakeups``), on channels located by a slot map read on
a client of their own, so reading it again never stalls a request's command.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from redis.asyncio import RedisCluster

from idempotency_gateway.replay.cluster_wakeups import ClusterWakeups
from idempotency_gateway.replay.redis_adapter import INVALIDATED, SET_UNLESS_INVALIDATED
from idempotency_gateway.replay.redis_commands import CommandClient
from idempotency_gateway.replay.redis_connection import (
    NodeSubscriber,
    cluster_client,
    redis_failures,
)
from idempotency_gateway.replay.redis_unavailable import RedisUnavailable


class SlotMap:
    """``ClusterTopology`` over a cluster client that serves no command."""

    def __init__(self, client: RedisCluster) -> None:
        self._client = client

    async def read_slot_map(self) -> None:
        with redis_failures():
            await self._client.nodes_manager.initialize()

    def primary_of(self, channel: str) -> str | None:
        with redis_failures():
            node = self._client.get_node_from_key(channel)
        return None if node is None else str(node.name)

    def subscriber(self, primary: str) -> NodeSubscriber:
        node = self._client.get_node(node_name=primary)
        assert node is not None, f"{primary} is not in the slot map"
        return NodeSubscriber.of(node)

    async def close(self) -> None:
        with redis_failures():
            await self._client.aclose()
            # A re-read slot map leaves the seed nodes' own connections open (aclose closes
            # the nodes of the map only).
            for seed in self._client.nodes_manager.startup_nodes.values():
                await seed.disconnect()


class ClusterRedis(CommandClient):
    def __init__(
        self, commands: RedisCluster, topology: RedisCluster, reader: RedisCluster
    ) -> None:
        super().__init__(commands, reader)
        self._client: RedisCluster = commands
        self._slot_map = SlotMap(topology)

    @classmethod
    def from_url(cls, url: str, *, timeout: float | None, connect_timeout: float) -> ClusterRedis:
        return cls(
            cluster_client(url, timeout=timeout, connect_timeout=connect_timeout),
            cluster_client(url, timeout=None, connect_timeout=connect_timeout),
            cluster_client(url, timeout=None, connect_timeout=connect_timeout),
        )

    async def get(self, name: str) -> object:
        with redis_failures():
            return await self._client.get(name)

    async def get_with_ttl(self, name: str) -> tuple[object, object]:
        with redis_failures():
            async with self._client.pipeline(transaction=False) as pipe:
                pipe.get(name)
                pipe.pttl(name)
                value, ttl_ms = await pipe.execute()
        return value, ttl_ms

    async def set_and_publish(self, name: str, value: bytes, *, ttl_ms: int, channel: str) -> None:
        with redis_failures():
            async with self._client.pipeline(transaction=False) as pipe:
                pipe.eval(SET_UNLESS_INVALIDATED, 1, name, value, ttl_ms, INVALIDATED)
                pipe.spublish(channel, b"1")
                await pipe.execute()

    async def publish(self, channel: str) -> None:
        with redis_failures():
            await self._client.spublish(channel, b"1")

    async def health(self, *, ping: Callable[[], Awaitable[bool]], ping_timeout: float) -> str:
        """Each primary that does not answer a PING, asked directly, past the cache's breaker,
        which an operator looking at readiness wants to see through."""
        try:
            async with asyncio.timeout(ping_timeout):
                with redis_failures():
                    await self._client.initialize()
        except (RedisUnavailable, TimeoutError):  # not one node can be named
            return "degraded: no cluster node answers"
        down = [
            node.name
            for node in self._client.get_primaries()
            if not await self._answers(node.name, ping_timeout)
        ]
        return f"degraded: {', '.join(sorted(down))} not answering" if down else "ok"

    async def _answers(self, name: str, ping_timeout: float) -> bool:
        node = self._client.get_node(node_name=name)
        try:
            async with asyncio.timeout(ping_timeout):
                with redis_failures():
                    return bool(await self._client.ping(target_nodes=node))
        except (RedisUnavailable, TimeoutError):
            return False

    def wakeups(self, *, timeout: float) -> ClusterWakeups:
        return ClusterWakeups(publisher=self, topology=self._slot_map, timeout=timeout)

    async def close(self) -> None:
        with redis_failures():
            await self._client.aclose()
        await self._slot_map.close()
        await self.close_reader()
