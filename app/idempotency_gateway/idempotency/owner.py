"""One owner's hold on a record: the lease heartbeat and the fenced finalize."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import secrets
from collections.abc import AsyncIterator

from idempotency_gateway.errors import StoreUnavailable
from idempotency_gateway.idempotency.record import Fence, Record, Status, StoredResponse
from idempotency_gateway.idempotency.store import RecordStore
from idempotency_gateway.telemetry.metrics import FENCED_WRITES

log = logging.getLogger(__name__)

# Pause between finalize attempts when the store hiccups; the lease bounds the total.
_FINALIZE_BACKOFF = 0.2


class _OwnerIds:
    """Owner ids unique across processes without a ``uuid4`` (a system call) per execution:
    80 random bits drawn once per process, then a counter (32 characters, as stored)."""

    def __init__(self) -> None:
        self._reseed()
        # A forked child must not repeat its parent's ids.
        os.register_at_fork(after_in_child=self._reseed)

    def _reseed(self) -> None:
        self._prefix = secrets.token_hex(10)
        self._counter = itertools.count()

    def next(self) -> str:
        return f"{self._prefix}{next(self._counter):012x}"


new_owner_id = _OwnerIds().next


class OwnerRun:
    def __init__(
        self, store: RecordStore, record: Record, *, lease: float, ttl: float, granted_at: float
    ) -> None:
        self.store = store
        self.record = record
        # This process's monotonic clock when the statement that granted ``record`` was sent.
        self.granted_at = granted_at
        self.lease = lease
        self.ttl = ttl
        self.fence = Fence(record.owner_id, record.fencing_token)
        self.fenced = False

    @contextlib.asynccontextmanager
    async def heartbeat(self) -> AsyncIterator[None]:
        """Renew the lease every third of it while the body of the ``async with`` runs."""
        beat = _Heartbeat(self)
        try:
            yield
        finally:
            await beat.stop()

    async def finalize(
        self, status: Status, answer: StoredResponse | None, *, attempts: int
    ) -> bool:
        """Write the outcome, retrying store errors: losing it would strand the key until
        its lease runs out. A fenced write is logged, changes nothing and returns False."""
        for attempt in range(1, attempts + 1):
            try:
                written = await self.store.finalize(
                    self.record.key, self.fence, status=status, response=answer, ttl=self.ttl
                )
            except StoreUnavailable:
                if attempt == attempts:
                    log.error(
                        "finalize failed: store unavailable; the record stays IN_PROGRESS "
                        "until its lease runs out",
                        extra={"status": status.value},
                    )
                    return False
                await asyncio.sleep(_FINALIZE_BACKOFF * attempt)
                continue
            if not written:
                self._note_fenced("finalize")
            return written
        return False

    def _note_fenced(self, write: str) -> None:
        self.fenced = True
        FENCED_WRITES.labels(write.replace(" ", "_")).inc()
        log.warning(
            "fenced %s: another owner holds this record now; nothing was changed",
            write,
            extra={
                "owner_id": self.fence.owner_id,
                "fencing_token": self.fence.fencing_token,
            },
        )


class _Heartbeat:
    """The lease renewal of one execution as a re-armed timer: most executions end long
    before the first renewal is due, and then cost one timer handle instead of a task."""

    def __init__(self, run: OwnerRun) -> None:
        self._run = run
        self._interval = run.lease / 3
        self._loop = asyncio.get_running_loop()
        self._renewal: asyncio.Task[None] | None = None
        self._stopped = False
        self._timer = self._loop.call_later(self._interval, self._due)

    def _due(self) -> None:
        self._renewal = self._loop.create_task(self._renew())

    async def _renew(self) -> None:
        run = self._run
        try:
            renewed = await run.store.renew_lease(run.record.key, run.fence, lease=run.lease)
        except StoreUnavailable:
            log.warning("lease renewal failed: store unavailable; will try again")
            renewed = True
        if not renewed:
            run._note_fenced("lease renewal")
            return
        if not self._stopped:
            self._timer = self._loop.call_later(self._interval, self._due)

    async def stop(self) -> None:
        self._stopped = True
        self._timer.cancel()
        if self._renewal is not None and not self._renewal.done():
            self._renewal.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._renewal
