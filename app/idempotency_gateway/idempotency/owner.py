"""One owner's hold on a record: the lease heartbeat and the fenced finalize."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from idempotency_gateway.errors import StoreUnavailable
from idempotency_gateway.idempotency.record import Fence, Record, Status, StoredResponse
from idempotency_gateway.idempotency.store import RecordStore
from idempotency_gateway.telemetry.metrics import FENCED_WRITES

log = logging.getLogger(__name__)

# Pause between finalize attempts when the store hiccups; the lease bounds the total.
_FINALIZE_BACKOFF = 0.2


class OwnerRun:
    def __init__(self, store: RecordStore, record: Record, *, lease: float, ttl: float) -> None:
        self.store = store
        self.record = record
        self.lease = lease
        self.ttl = ttl
        self.fence = Fence(record.owner_id, record.fencing_token)
        self.fenced = False

    @contextlib.asynccontextmanager
    async def heartbeat(self) -> AsyncIterator[None]:
        """Renew the lease every third of it while the body of the ``async with`` runs."""
        task = asyncio.create_task(self._renew_forever())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _renew_forever(self) -> None:
        interval = self.lease / 3
        while True:
            await asyncio.sleep(interval)
            try:
                renewed = await self.store.renew_lease(
                    self.record.key, self.fence, lease=self.lease
                )
            except StoreUnavailable:
                log.warning("lease renewal failed: store unavailable; will try again")
                continue
            if not renewed:
                self._note_fenced("lease renewal")
                return

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
