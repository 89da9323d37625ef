"""An upstream that speaks raw bytes over loopback, for what a framework server never sends.

    async def answer(request: Received, reader: StreamReader, writer: StreamWriter) -> None:
        writer.write(b"HTTP/1.1 204 No Content\\r\\n\\r\\n")

    async with RawUpstream(answer) as upstream:
        ...  # upstream.url; upstream.requests; upstream.opened / upstream.closed

Every request is recorded exactly as it arrived (its head up to the empty line, and a body of
the ``Content-Length`` it declared) with the number of the connection it came on, then
``answer`` writes whatever the test wants: interim answers, odd framing, half a body, a reset,
or nothing at all. Connections stay open for the next request until either side closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from tests.support.lifecycle import StartedInContext
from tests.support.waiting import eventually

_CONTENT_LENGTH = re.compile(rb"\r\ncontent-length: *(\d+)", re.IGNORECASE)


@dataclass(frozen=True)
class Received:
    connection: int
    """1 for the first connection the upstream accepted, 2 for the second ..."""
    head: bytes
    """The request line and fields as they arrived, through the empty line."""
    body: bytes


Answer = Callable[[Received, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def until_closed(reader: asyncio.StreamReader) -> None:
    """Hold an answer back until the client closes the connection (it never comes)."""
    with contextlib.suppress(ConnectionError):
        while await reader.read(65536):
            pass


class RawUpstream(StartedInContext):
    def __init__(
        self, answer: Answer, *, host: str = "127.0.0.1", tls: ssl.SSLContext | None = None
    ) -> None:
        """``tls``: serve https with this server context (its certificate, and whether it
        asks for the client's)."""
        self._answer = answer
        self._host = host
        self._tls = tls
        self.requests: list[Received] = []
        self.opened = 0
        """Connections accepted."""
        self.closed = 0
        """Connections that ended, whichever side closed them."""
        self.writers: list[asyncio.StreamWriter] = []
        """Every connection's writer, in the order they were accepted."""
        self._server: asyncio.Server | None = None
        self._port: int | None = None
        self._handlers: set[asyncio.Task[Any]] = set()

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("RawUpstream is not started")
        return self._port

    @property
    def url(self) -> str:
        scheme = "https" if self._tls is not None else "http"
        return f"{scheme}://{self._host}:{self.port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, self._host, 0, ssl=self._tls)
        self._port = int(self._server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        for writer in self.writers:
            writer.transport.abort()
        for task in list(self._handlers):
            task.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)
        await server.wait_closed()

    async def received(self, count: int) -> list[Received]:
        """The requests, once at least ``count`` arrived."""
        await eventually(lambda: len(self.requests) >= count, message=f"{count} requests")
        return self.requests

    async def wait_closed(self, count: int) -> None:
        await eventually(lambda: self.closed >= count, message=f"{count} connections closed")

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        self.opened += 1
        number = self.opened
        self.writers.append(writer)
        try:
            while not writer.is_closing():
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                    declared = _CONTENT_LENGTH.search(head)
                    body = await reader.readexactly(int(declared[1])) if declared else b""
                except (asyncio.IncompleteReadError, ConnectionError):
                    break
                received = Received(number, head, body)
                self.requests.append(received)
                await self._answer(received, reader, writer)
                with contextlib.suppress(ConnectionError):
                    await writer.drain()
        finally:
            self.closed += 1
            writer.transport.abort()
            self._handlers.discard(task)
