"""Servers run by a thread's own event loop, for synchronous tests (hypothesis) that talk to
them with blocking raw sockets.

A subclass writes ``_serve``: start what it needs, call ``self._started()``, then
``await self._stopping()``. ``with Subclass(...) as running:`` returns once it started (or
raises what prevented it) and stops it on exit.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Self


class InBackgroundThread:
    def __init__(self, *, name: str, startup_timeout: float = 60.0) -> None:
        self._startup_timeout = startup_timeout
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    async def _serve(self) -> None:
        raise NotImplementedError

    def _started(self) -> None:
        self._ready.set()

    async def _stopping(self) -> None:
        assert self._stop is not None
        await self._stop.wait()

    def _run(self) -> None:
        async def serve() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            await self._serve()

        try:
            asyncio.run(serve())
        except BaseException as exc:  # reported to the test thread, never lost in this one
            self._failure = exc
            self._ready.set()

    def __enter__(self) -> Self:
        self._thread.start()
        if not self._ready.wait(self._startup_timeout):
            raise TimeoutError(f"{self._thread.name} did not start in {self._startup_timeout} s")
        if self._failure is not None:
            raise RuntimeError(f"{self._thread.name} failed to start") from self._failure
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30.0)
