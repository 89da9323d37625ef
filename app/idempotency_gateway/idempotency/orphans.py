"""``OrphanReleases``: claims that committed after the gateway stopped waiting for them.

A reserve (or a take-over of a record nobody had sent) that fails on the gateway, a timeout
or a dropped connection, may still commit in the database: the row then holds the key
``IN_PROGRESS`` under an owner that answered its client 503 and will never execute. Left
alone it answers 409 for a lease and then, taken over as abandoned, "outcome unknown" for
good, with zero executions. Its owner knows it never sent anything, so it releases the row
as not executed (``RecordStore.release_unsent``, fenced by the owner id) once the store
answers again, and the key runs normally on its next request.

Orphans wait in a bounded queue, released one at a time by a task that runs only while the
queue holds something; an orphan is given up once its record's TTL has passed (the record
is forgotten anyway by then).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from idempotency_gateway.errors import StoreUnavailable
from idempotency_gateway.resilience.backoff import full_jitter
from idempotency_gateway.storage.base import RecordStore
from idempotency_gateway.storage.records import RecordKey
from idempotency_gateway.telemetry.metrics import ORPHAN_RELEASES

log = logging.getLogger(__name__)

# Orphans come from store faults only, a handful per outage per process; more than this
# waiting means the store has been down for long, and the oldest stay queued first.
CAPACITY = 1024
# Retries while the store is down: soon after it answers again, never a busy loop.
_BACKOFF_BASE = 0.05
_BACKOFF_CAP = 1.0


@dataclass(frozen=True, slots=True)
class _Orphan:
    key: RecordKey
    owner_id: str
    give_up_at: float


class OrphanReleases:
    def __init__(
        self,
        store: RecordStore,
        *,
        capacity: int = CAPACITY,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store = store
        self._capacity = capacity
        self._monotonic = monotonic
        self._pending: deque[_Orphan] = deque()
        self._worker: asyncio.Task[None] | None = None

    @property
    def pending(self) -> int:
        return len(self._pending)

    def add(self, key: RecordKey, owner_id: str, *, ttl: float) -> None:
        """Release ``owner_id``'s claim on ``key`` (if it committed) as soon as the store
        answers, for up to ``ttl`` seconds. Never blocks."""
        if len(self._pending) >= self._capacity:
            ORPHAN_RELEASES.labels("dropped").inc()
            log.error(
                "orphan release queue full: a claim that may have committed is left to its lease",
                extra={"owner_id": owner_id},
            )
            return
        self._pending.append(_Orphan(key, owner_id, self._monotonic() + ttl))
        if self._worker is None or self._worker.done():
            self._worker = asyncio.get_running_loop().create_task(self._release_all())

    async def _release_all(self) -> None:
        failures = 0
        while self._pending:
            orphan = self._pending[0]
            if self._monotonic() >= orphan.give_up_at:
                self._pending.popleft()
                ORPHAN_RELEASES.labels("dropped").inc()
                continue
            try:
                released = await self._store.release_unsent(orphan.key, orphan.owner_id)
            except StoreUnavailable:
                await asyncio.sleep(full_jitter(failures, base=_BACKOFF_BASE, cap=_BACKOFF_CAP))
                failures += 1
                continue
            failures = 0
            self._pending.popleft()
            ORPHAN_RELEASES.labels("released" if released else "absent").inc()
            if released:
                log.warning(
                    "released a claim that committed after its request had failed; the key "
                    "was never executed and will run on its next request",
                    extra={"owner_id": orphan.owner_id},
                )

    async def close(self) -> None:
        """Stop releasing; whatever is still queued stays to its lease."""
        if self._worker is not None and not self._worker.done():
            self._worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._worker
        if self._pending:
            log.warning("%d orphan claims left unreleased at shutdown", len(self._pending))
