"""A TCP forwarder the test can cut: a dependency "goes down" for one client only.

    async with TcpProxy("127.0.0.1", 5432) as proxy:
        url = proxy.rewrite_url(postgres_url)      # the gateway talks to PostgreSQL through it
        await proxy.cut()                          # every connection dies, new ones are reset
        await eventually(lambda: proxy.rejected >= 1)
        await proxy.restore()                      # forwarding again
        proxy.pause()                              # bytes stop both ways, nothing closes
        proxy.resume()                             # the held bytes flow on

It runs in the test's event loop on ``127.0.0.1:<ephemeral>``. While cut it still accepts, but
resets each new connection at once (SO_LINGER 0) without contacting the target, and counts
it in ``rejected``: the client sees the dependency refuse, the test sees that it tried.
While paused, every open and new connection stays open but no byte crosses it (a partition:
packets stop, nothing closes); ``held`` counts the reads waiting to be passed on.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from typing import Any

from sqlalchemy.engine import make_url

from tests.support.lifecycle import StartedInContext

LOOPBACK = "127.0.0.1"
_CHUNK = 65536


def reset(writer: asyncio.StreamWriter) -> None:
    """Abort the connection with a TCP RST instead of an orderly close."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class TcpProxy(StartedInContext):
    def __init__(self, target_host: str, target_port: int, *, host: str = LOOPBACK) -> None:
        self.target_host = target_host
        self.target_port = target_port
        self.host = host
        self.rejected = 0
        """Connections refused (reset at once) while the proxy was cut."""
        self.forwarded = 0
        """Connections forwarded to the target."""
        self._server: asyncio.Server | None = None
        self._port: int | None = None
        self._cut = False
        self._flowing = asyncio.Event()
        self._flowing.set()
        self.held = 0
        """Reads waiting for ``resume`` to be passed on."""
        self._links: set[asyncio.Future[Any]] = set()
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("TcpProxy is not started")
        return self._port

    @property
    def is_cut(self) -> bool:
        return self._cut

    def rewrite_url(self, url: str) -> str:
        """``url`` (any SQLAlchemy or Redis-style URL) with its host and port pointing here."""
        return make_url(url).set(host=self.host, port=self.port).render_as_string(False)

    async def start(self) -> None:
        if self._server is not None:
            raise RuntimeError("TcpProxy already started")
        self._server = await asyncio.start_server(self._accept, self.host, 0)
        self._port = int(self._server.sockets[0].getsockname()[1])

    async def cut(self) -> None:
        """Kill every open connection (reset) and refuse new ones until ``restore``."""
        self._cut = True
        for writer in list(self._writers):
            reset(writer)
        await self._settle()

    async def restore(self) -> None:
        """Forward new connections again."""
        self._cut = False

    def pause(self) -> None:
        """Stop passing bytes on, both ways, without closing anything, until ``resume``."""
        self._flowing.clear()

    def resume(self) -> None:
        self._flowing.set()

    async def close(self) -> None:
        self.resume()
        server, self._server = self._server, None
        if server is not None:
            server.close()
        for writer in list(self._writers):
            reset(writer)
        await self._settle()
        if server is not None:
            await server.wait_closed()

    async def _settle(self) -> None:
        links = [task for task in self._links if not task.done()]
        if links:
            await asyncio.gather(*links, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._cut:
            self.rejected += 1
            reset(writer)
            return
        try:
            target_reader, target_writer = await asyncio.open_connection(
                self.target_host, self.target_port
            )
        except OSError:
            reset(writer)
            return
        self.forwarded += 1
        self._writers.update((writer, target_writer))
        link = asyncio.gather(
            self._pipe(reader, target_writer, writer),
            self._pipe(target_reader, writer, target_writer),
        )
        self._links.add(link)
        try:
            await link
        finally:
            self._links.discard(link)
            self._writers.difference_update((writer, target_writer))
            for end in (writer, target_writer):
                end.close()

    async def _pipe(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        other: asyncio.StreamWriter,
    ) -> None:
        """Copy ``reader`` to ``writer``; when either side fails, reset both."""
        try:
            while data := await reader.read(_CHUNK):
                if not self._flowing.is_set():
                    self.held += 1
                    await self._flowing.wait()
                    self.held -= 1
                writer.write(data)
                await writer.drain()
            if writer.can_write_eof():
                writer.write_eof()
        except (OSError, RuntimeError):
            reset(writer)
            reset(other)
