"""A keyed POST over a raw socket whose answer is read event by event, and can be dropped
mid-stream by closing the socket (no HTTP client in between to retry or buffer)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Sequence
from typing import Self

from tests.support.raw_http import request_bytes


class RawEventStream:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader, self._writer = reader, writer
        self.status = 0
        self.headers: dict[str, str] = {}
        self._chunked = False
        self._length: int | None = None
        self._body = b""  # read and de-framed, not yet handed out
        self._read = 0  # body bytes handed out
        self.whole = False  # the body's framing said it ended (not a cut connection)

    @classmethod
    async def open(
        cls,
        port: int,
        path: str,
        headers: Sequence[tuple[bytes, bytes]],
        body: bytes,
        *,
        receive_buffer: int | None = None,
    ) -> Self:
        """Send the request and read the answer's head. ``receive_buffer``: a small socket
        receive buffer, for a client that stops reading."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if receive_buffer is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
        reader, writer = await asyncio.open_connection(sock=sock, limit=1 << 20)
        stream = cls(reader, writer)
        writer.write(request_bytes(b"POST", path.encode(), headers, body))
        await writer.drain()
        await stream._read_head()
        return stream

    async def _read_head(self) -> None:
        head = await self._reader.readuntil(b"\r\n\r\n")
        status_line, *fields = head.decode("latin-1").split("\r\n")
        self.status = int(status_line.split()[1])
        for field in filter(None, fields):
            name, _, value = field.partition(":")
            self.headers[name.strip().lower()] = value.strip()
        self._chunked = self.headers.get("transfer-encoding") == "chunked"
        if "content-length" in self.headers:
            self._length = int(self.headers["content-length"])
        self.whole = self._length == 0

    async def _read_more(self) -> bool:
        """De-frame the next piece of the body; false at its end (or the connection's)."""
        if self.whole:
            return False
        try:
            if not self._chunked:
                assert self._length is not None
                piece = await self._reader.read(self._length - self._read - len(self._body))
                self._body += piece
                self.whole = self._read + len(self._body) == self._length
                return bool(piece)
            size = int((await self._reader.readuntil(b"\r\n")).split(b";")[0], 16)
            if size == 0:
                await self._reader.readuntil(b"\r\n")
                self.whole = True
                return False
            self._body += (await self._reader.readexactly(size + 2))[:-2]
            return True
        except (asyncio.IncompleteReadError, ConnectionError):
            return False

    async def events(self, count: int) -> list[bytes]:
        """The next ``count`` events (each up to its blank line), reading as needed."""
        events: list[bytes] = []
        while len(events) < count:
            end = self._body.find(b"\n\n")
            if end < 0:
                if not await self._read_more():
                    raise AssertionError(f"the stream ended after {len(events)} of {count}")
                continue
            event, self._body = self._body[: end + 2], self._body[end + 2 :]
            self._read += len(event)
            events.append(event)
        return events

    async def rest(self) -> bytes:
        """Everything until the body (or the connection) ends; ``whole`` says which."""
        while await self._read_more():
            pass
        rest, self._body = self._body, b""
        self._read += len(rest)
        return rest

    def drop(self) -> None:
        """Close the socket mid-stream, as a client whose connection dropped."""
        self._writer.close()

    async def close(self) -> None:
        self._writer.close()
        with contextlib.suppress(ConnectionError):
            await self._writer.wait_closed()
