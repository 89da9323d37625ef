"""One owner's hold on a record: the lease heartbeat and the fenced finalize."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import secrets
from collections.abc import AsyncIterator

from idempotency_gateway.errors import LeaseNotConfirmed, StoreUnavailable
from idempotency_gateway.idempotency.lease import Lease
from idempotency_gateway.resilience.backoff import full_jitter
from idempotency_gateway.storage.base import RecordStore
from idempotency_gateway.storage.records import Fence, Record, Status, StoredResponse
from idempotency_gateway.telemetry.metrics import FENCED_WRITES

log = logging.getLogger(__name__)

# Pauses between finalize attempts while the store does not answer: short at first (most
# outages are a dropped connection), never longer than the cap, so a store that comes back
# within the lease is found within the cap.
_FINALIZE_BACKOFF_BASE = 0.05
_FINALIZE_BACKOFF_CAP = 0.5


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
    """``sent_at``: the lease clock's reading taken before the statement that granted the
    lease (reserve or take-over) was sent; the lease is trusted from there (``Lease``)."""

    def __init__(
        self, store: RecordStore, record: Record, *, lease: float, ttl: float, sent_at: float
    ) -> None:
        self.store = store
        self.record = record
        self.ttl = ttl
        self.fence = Fence(record.owner_id, record.fencing_token)
        self.sent_at = sent_at
        self.lease = Lease(store, record.key, self.fence, length=lease, sent_at=sent_at)
        self.fenced = False
        # The record as the store last showed it after a finalize that matched no row: what
        # a fenced-off owner's client gets instead (``None``: the record is gone).
        self.of_record: Record | None = None

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
        """Write the outcome; ``False`` when it cannot be recorded. Losing it would settle an
        executed request as "outcome unknown", so store errors are retried (with backoff) at
        least ``attempts`` times and on until the lease runs out: until then no other owner
        can take the record, and the fence keeps any later write harmless.

        A write that matched no row is not yet a fence: an earlier attempt may have committed
        although its answer was lost. The record is read back, and one that holds this
        owner's outcome under its owner id and token counts as written."""
        attempt = 0
        while True:
            try:
                written = await self.store.finalize(
                    self.record.key, self.fence, status=status, response=answer, ttl=self.ttl
                )
                if written or await self._committed_before(status):
                    return True
            except StoreUnavailable:
                pause = full_jitter(attempt, base=_FINALIZE_BACKOFF_BASE, cap=_FINALIZE_BACKOFF_CAP)
                attempt += 1
                if attempt >= attempts and pause >= self.lease.remaining():
                    log.error(
                        "finalize failed: store unavailable until the lease ran out; the "
                        "record stays IN_PROGRESS until another owner takes it over",
                        extra={"status": status.value, "attempts": attempt},
                    )
                    return False
                await asyncio.sleep(pause)
                continue
            self._note_fenced("finalize")
            return False

    async def _committed_before(self, status: Status) -> bool:
        """Whether the record already holds this owner's outcome (a finalize whose commit
        outlived its answer); keeps what it read in ``of_record``."""
        self.of_record = record = await self.store.get(self.record.key)
        return (
            record is not None
            and record.status is status
            and record.owner_id == self.fence.owner_id
            and record.fencing_token == self.fence.fencing_token
        )

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
        self._interval = run.lease.length / 3
        self._loop = asyncio.get_running_loop()
        self._renewal: asyncio.Task[None] | None = None
        self._stopped = False
        self._timer = self._loop.call_later(self._interval, self._due)

    def _due(self) -> None:
        self._renewal = self._loop.create_task(self._renew())

    async def _renew(self) -> None:
        run = self._run
        try:
            await run.lease.renew()
        except LeaseNotConfirmed as refusal:
            if refusal.fenced:
                run._note_fenced("lease renewal")
                return
            # Not renewed, so no longer trusted: the execution sends nothing more until a
            # confirmation succeeds, and this timer keeps trying.
            log.warning(
                "lease renewal failed (%s); the execution sends nothing more until one succeeds",
                type(refusal.__cause__).__name__,
            )
        if not self._stopped:
            self._timer = self._loop.call_later(self._interval, self._due)

    async def stop(self) -> None:
        self._stopped = True
        self._timer.cancel()
        if self._renewal is not None and not self._renewal.done():
            self._renewal.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._renewal
