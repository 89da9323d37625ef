"""The ``async with`` protocol shared by the test services (upstream, TCP proxy, gateway
process, private Redis): entering starts the service, leaving always shuts it down, so a
failing test never leaks a port, a task or a child process."""

from __future__ import annotations

from types import TracebackType
from typing import Self


class StartedInContext:
    """Mixin: ``async with service:`` awaits ``start()`` on entry and ``close()`` on exit.

    A subclass defines ``start`` and ``close``; ``close`` must be safe to call more than once
    (tests may shut a service down themselves before the ``async with`` block ends).
    """

    async def start(self) -> None:
        raise NotImplementedError

    async def close(self) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()
