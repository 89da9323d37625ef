"""What follows a chunk size line, bounded as a request head is.

After a size line comes the chunk's data or, after the last (empty) chunk, the trailer
section. httptools accumulates a trailer field whole before it calls back, so a field that
never ends would grow in the parser until the body's own deadline: from a size line, the
chunk's data or the message's end must come within ``request_head_timeout``, and reads that
bring neither may add at most ``max_request_head`` bytes (the read that holds the size line
itself is not counted: at most one read more).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from idempotency_gateway.config import LimitsConfig
from idempotency_gateway.errors import GatewayError, RequestHeadTooLarge, RequestTimeout

ReadMark = tuple[bool, int]
"""Where a read began: whether a size line was waiting for what follows, and how often
what follows had arrived by then."""


class ChunkWatch:
    __slots__ = ("_arrivals", "_limits", "_loop", "_refuse", "_timer", "_unreported", "awaiting")

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        limits: LimitsConfig,
        refuse: Callable[[GatewayError], None],
    ) -> None:
        self._loop = loop
        self._limits = limits
        self._refuse = refuse
        self.awaiting = False
        """A size line was read; neither the chunk's data nor the message's end since."""
        self._arrivals = 0
        self._unreported = 0
        self._timer: asyncio.TimerHandle | None = None

    def size_line(self) -> None:
        self.awaiting = True

    def arrived(self) -> None:
        """The chunk's data, or the end of the message, came."""
        self.awaiting = False
        self._arrivals += 1
        self._unreported = 0
        self.cancel()

    def mark(self) -> ReadMark:
        return self.awaiting, self._arrivals

    def after_read(self, mark: ReadMark, size: int) -> None:
        """Count a read that left a size line still waiting, and refuse past the bounds."""
        if not self.awaiting:
            return
        if mark == (True, self._arrivals):
            self._unreported += size  # all of it held by the parser, unreported
        if self._unreported > self._limits.max_request_head:
            self._refuse(
                RequestHeadTooLarge(
                    "the request's trailer section is larger than "
                    f"{self._limits.max_request_head} bytes"
                )
            )
        elif self._timer is None:
            self._timer = self._loop.call_later(self._limits.request_head_timeout, self._too_late)

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _too_late(self) -> None:
        self._timer = None
        self._refuse(
            RequestTimeout(
                "the request's trailer section (or a chunk after its size line) did not "
                f"arrive within {self._limits.request_head_timeout:g}s"
            )
        )
