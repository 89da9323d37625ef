"""The keep-alive connections to one upstream: at most ``max_connections``, idle ones LIFO.

The most recently used idle connection goes out first (warm, and the least likely to have
been closed by the upstream's own idle timeout); idle ones older than ``keepalive`` are
closed, by a timer for the oldest and again when one is taken. A connection the upstream
closes while idle leaves the pool at once. Waiting for room under the cap and connecting
share one deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections import deque

from idempotency_gateway.proxy.connection import UpstreamConnection

_SWEEP_SLACK = 0.01


class ConnectionPool:
    def __init__(
        self,
        upstream: str,
        *,
        host: str,
        port: int,
        ssl_context: ssl.SSLContext | None,
        server_name: str | None = None,
        max_connections: int,
        keepalive: float,
    ) -> None:
        self.upstream = upstream
        self._host = host
        self._port = port
        self._ssl = ssl_context
        self._server_name = server_name
        self._max = max_connections
        self._keepalive = keepalive
        self.loop = asyncio.get_running_loop()
        # Oldest first: connections are pushed and popped at the end.
        self._idle: list[UpstreamConnection] = []
        self._open = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._sweep: asyncio.TimerHandle | None = None
        self._closed = False

    @property
    def open_connections(self) -> int:
        return self._open

    @property
    def idle_connections(self) -> int:
        return len(self._idle)

    def idle_connection(self, now: float) -> UpstreamConnection | None:
        """The newest idle connection still fit for a request, if any."""
        idle = self._idle
        while idle:
            connection = idle.pop()
            if not connection.closed and now - connection.idle_since < self._keepalive:
                connection.idle = False
                return connection
            self._discard(connection)
        return None

    async def connect(self, deadline: float) -> UpstreamConnection:
        """A connection once the cap allows one (an idle one if it came back meanwhile), by
        ``deadline`` (loop time) or ``TimeoutError``; the connect's ``OSError`` otherwise."""
        async with asyncio.timeout_at(deadline):
            while self._open >= self._max:
                await self._wait_for_room()
                connection = self.idle_connection(self.loop.time())
                if connection is not None:
                    return connection
            self._open += 1
            try:
                _, connection = await self.loop.create_connection(
                    self._new_connection,
                    self._host,
                    self._port,
                    ssl=self._ssl,
                    server_hostname=self._server_name,
                )
            except BaseException:
                self._free()
                raise
        return connection

    def release(self, connection: UpstreamConnection, *, reusable: bool) -> None:
        if not reusable or connection.closed or self._closed:
            self._discard(connection)
            return
        connection.make_idle(self.loop.time())
        self._idle.append(connection)
        if self._sweep is None:
            self._schedule_sweep()
        if self._waiters:
            self._wake_one()

    def close(self) -> None:
        """Close every idle connection; the ones in use close when released."""
        self._closed = True
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        idle, self._idle = self._idle, []
        for connection in idle:
            self._discard(connection)

    # ----------------------------------------------------------------------- inner

    def _new_connection(self) -> UpstreamConnection:
        return UpstreamConnection(self.upstream, self._idle_closed)

    def _idle_closed(self, connection: UpstreamConnection) -> None:
        """The upstream closed an idle connection: it leaves the pool and frees its place."""
        with contextlib.suppress(ValueError):
            self._idle.remove(connection)
            connection.idle = False
            self._free()

    def _discard(self, connection: UpstreamConnection) -> None:
        connection.idle = False
        connection.close()
        self._free()

    def _free(self) -> None:
        self._open -= 1
        self._wake_one()

    async def _wait_for_room(self) -> None:
        waiter = self.loop.create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        except BaseException:
            if waiter.cancelled():
                with contextlib.suppress(ValueError):
                    self._waiters.remove(waiter)
            else:
                self._wake_one()  # woken, then cancelled: the turn goes to the next one
            raise

    def _wake_one(self) -> None:
        waiters = self._waiters
        while waiters:
            waiter = waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def _schedule_sweep(self) -> None:
        oldest = self._idle[0]
        self._sweep = self.loop.call_at(oldest.idle_since + self._keepalive, self._sweep_idle)

    def _sweep_idle(self) -> None:
        self._sweep = None
        now = self.loop.time()
        idle = self._idle
        # A timer may fire a little early: the slack keeps it from firing again and again.
        while idle and now - idle[0].idle_since >= self._keepalive - _SWEEP_SLACK:
            self._discard(idle.pop(0))
        if idle:
            self._schedule_sweep()
