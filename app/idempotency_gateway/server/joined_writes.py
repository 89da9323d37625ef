"""The response head goes out with the first piece of the body: one ``send`` instead of two.

uvicorn writes the status line and fields, then each body message, as separate transport
writes; for the usual small answer that is two system calls and two loopback segments where
one does. ``HeadWithBody`` wraps a request cycle's transport: the first write (the head) is
held until the next write, which carries both (``writelines``: no copy), or until the end of
the current loop iteration, so an app that starts a response and then waits still gets its
head out at once. Closing flushes it first, then closes as the connection's protocol says
(it may linger for a request body still coming).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any


class HeadWithBody:
    __slots__ = ("_close", "_first", "_flush", "_held", "_loop", "_transport")

    def __init__(
        self,
        transport: asyncio.Transport,
        loop: asyncio.AbstractEventLoop,
        *,
        close: Callable[[], None] | None = None,
    ) -> None:
        self._transport = transport
        self._close = close or transport.close
        self._loop = loop
        self._held: bytes | None = None
        self._flush: asyncio.Handle | None = None
        self._first = True

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._first:
            self._first = False
            self._held = bytes(data)
            self._flush = self._loop.call_soon(self._write_held)
            return
        held = self._held
        if held is None:
            self._transport.write(data)
            return
        self._held = None
        assert self._flush is not None
        self._flush.cancel()
        self._transport.writelines((held, data))

    def _write_held(self) -> None:
        held, self._held = self._held, None
        if held is not None and not self._transport.is_closing():
            self._transport.write(held)

    def close(self) -> None:
        if self._flush is not None:
            self._flush.cancel()
        self._write_held()
        self._close()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)
