"""Every live stream's appends of one process, in one pipelined round trip at a time.

Owners hand their entries over and go on at once; one task sends whatever has gathered
(XADD per entry, EXPIRE per stream) while the next entries gather. Each entry carries its
own id (``0-<n>``, the n-th entry of its stream), so a batch that failed half-way, or timed
out after Redis applied it, is sent again whole: Redis refuses the entries it already holds
(an id no greater than the stream's last), and the rest land in order. (A batch holding a
stream's first entry deletes the stream before it, so sent again it lands whole again.)
Entries wait no longer than their stream's ``idle`` (by then followers are cut and the
stream expires), so a Redis that stays away costs at most what the streams of that window
hold.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

from idempotency_gateway.clock import Monotonic, monotonic
from idempotency_gateway.replay.redis_adapter import Fields, RedisAdapter, StreamAppend
from idempotency_gateway.replay.redis_unavailable import RedisUnavailable
from idempotency_gateway.telemetry.degradation import DegradationLog

# After a failed batch: Redis is away or overloaded, and asking at once would not help.
_RETRY_PAUSE = 0.2


@dataclass(frozen=True, slots=True)
class Append:
    stream: str
    entry_id: str
    fields: Fields
    idle: float
    queued_at: float = field(compare=False)
    # A stream's first entry: what an earlier owner of the key left there goes first (its
    # ids would refuse this owner's, and its events must never reach this one's followers).
    first: bool = False


class Appender:
    def __init__(
        self,
        redis: RedisAdapter,
        *,
        timeout: float,
        degradation: DegradationLog,
        clock: Monotonic = monotonic,
    ) -> None:
        self._redis, self._timeout, self._degradation = redis, timeout, degradation
        self._clock = clock
        self._pending: list[Append] = []
        self._news = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._task: asyncio.Task[None] | None = None

    def add(
        self, stream: str, entry_id: str, fields: Fields, *, idle: float, first: bool = False
    ) -> None:
        self._pending.append(Append(stream, entry_id, fields, idle, self._clock(), first))
        self._news.set()
        self._idle.clear()
        if self._task is None:
            self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        batch: list[Append] = []
        while True:
            if not batch and not self._pending:
                self._idle.set()
                self._news.clear()
                await self._news.wait()
            now = self._clock()
            batch = [entry for entry in batch + self._pending if now - entry.queued_at < entry.idle]
            self._pending = []
            if batch and not await self._send(batch):
                await asyncio.sleep(_RETRY_PAUSE)
                continue
            batch = []

    async def _send(self, batch: list[Append]) -> bool:
        appends = [
            StreamAppend(entry.stream, entry.entry_id, entry.fields, replace=entry.first)
            for entry in batch
        ]
        expiries = {entry.stream: max(round(entry.idle), 1) for entry in batch}
        try:
            async with asyncio.timeout(self._timeout):
                await self._redis.append_to_streams(appends, expiries=expiries)
        except (RedisUnavailable, TimeoutError) as exc:
            self._degradation.failed(exc)
            return False
        return True

    async def flushed(self) -> None:
        """Until every entry handed over so far is sent, or given up."""
        await self._idle.wait()

    async def close(self) -> None:
        """Send what is waiting (for at most the timeout), then stop."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self._timeout):
                await self.flushed()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
