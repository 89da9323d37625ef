"""Commands on redis-py's own connections, past the client's per-call layers.

Each ``Redis.execute_command`` goes through a retry wrapper, an event dispatcher, an
observability recorder and the pool's health check on every call: on a replay that was more
client CPU than the gateway's own work (``benchmarks/redis_clients.py``: a GET costs about
50 us that way and about 21 us on a bare connection). The replay cache asks a single node
for one GET or one pipelined SET + PUBLISH per request, so it sends them on connections of
the client's own pool class and settings (auth, TLS, database, RESP version and timeouts all
apply, redis-py connects them) and keeps the idle ones itself.

A connection goes back to the idle list only after every reply of its commands was read.
Any failure or cancellation closes it, so a reply can never be read as the answer to a later
command, and closes the idle ones too, so a Redis that restarted costs one failure, not one
per connection the busiest moment left idle. (``cache.decode`` also checks that an entry
names the key it was asked for.)
A Redis Cluster keeps the full client, which routes by slot.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.connection import AbstractConnection
from redis.typing import EncodableT

Command = Sequence[EncodableT]


class DirectCommands:
    def __init__(self, redis: Redis) -> None:
        self._pool = redis.connection_pool
        self._idle: list[AbstractConnection] = []

    async def run(self, *commands: Command) -> list[Any]:
        """The replies to ``commands``, sent together in one write: one round trip."""
        connection = self._idle.pop() if self._idle else self._new_connection()
        try:
            packed = (
                connection.pack_command(*commands[0])
                if len(commands) == 1
                else connection.pack_commands(commands)
            )
            await connection.send_packed_command(packed, check_health=False)
            replies = [await connection.read_response() for _ in commands]
        except BaseException:
            # The idle ones were opened before this failure and most likely share its cause
            # (Redis restarted, killed its clients, or a network path broke): each would cost
            # a later command a failure of its own, and a half-open breaker's probe the whole
            # probe. They go too; the next command connects afresh.
            idle, self._idle = self._idle, []
            for dropped in (connection, *idle):
                with contextlib.suppress(Exception):
                    await dropped.disconnect(nowait=True)
            raise
        self._idle.append(connection)
        return replies

    def _new_connection(self) -> AbstractConnection:
        connection: AbstractConnection = self._pool.make_connection()  # type: ignore[no-untyped-call]
        return connection

    async def close(self) -> None:
        idle, self._idle = self._idle, []
        for connection in idle:
            with contextlib.suppress(Exception):
                await connection.disconnect()
