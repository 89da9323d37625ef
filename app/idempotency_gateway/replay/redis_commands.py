"""``CommandClient``: the commands one node and a cluster send alike, through redis-py's own
methods, each failure ``RedisUnavailable`` (``redis_failures``).

Among them the live streams' (``redis_live_streams``): appends pipelined in one round trip,
a stream's first entry, and followers' blocking reads (XREAD BLOCK), which go on a client of
their own with no socket timeout, so a read that waits for long holds up no quick command.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, cast

from redis.asyncio import Redis, RedisCluster

from idempotency_gateway.replay.redis_adapter import INVALIDATED, Entries, StreamAppend
from idempotency_gateway.replay.redis_connection import redis_failures


class CommandClient:
    def __init__(self, client: Redis | RedisCluster, reader: Redis | RedisCluster) -> None:
        """``client``: quick commands, under the adapter's timeout; ``reader``: blocking reads."""
        self._client = client
        self._reader = reader

    async def invalidate(self, name: str, *, ttl_ms: int) -> None:
        with redis_failures():
            await self._client.set(name, INVALIDATED, px=ttl_ms)

    async def ping(self) -> bool:
        with redis_failures():
            return bool(await self._client.ping())

    async def append_to_streams(
        self, appends: Sequence[StreamAppend], *, expiries: Mapping[str, int]
    ) -> None:
        pipe = self._client.pipeline(transaction=False)
        for append in appends:
            if append.replace:
                pipe.delete(append.stream)
            pipe.xadd(append.stream, append.fields, id=append.entry_id)  # type: ignore[arg-type]
        for stream, seconds in expiries.items():
            pipe.expire(stream, seconds)
        with redis_failures():
            # An entry Redis already holds answers an error: it is there, as it should be.
            await pipe.execute(raise_on_error=False)

    async def first_entry(self, stream: str) -> Entries:
        with redis_failures():
            return cast(Entries, await self._client.xrange(stream, count=1))

    async def read_stream(self, stream: str, after: bytes, *, count: int, block_ms: int) -> Entries:
        with redis_failures():
            reply: Any = await self._reader.xread({stream: after}, count=count, block=block_ms)
        # The entries of its one stream; none when the read timed out.
        return cast(Entries, reply[0][1]) if reply else []

    async def close_reader(self) -> None:
        with redis_failures():
            await self._reader.aclose()
