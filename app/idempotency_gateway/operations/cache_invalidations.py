"""Admin deletes and expiries reach every process's in-process replay cache.

Without Redis each worker keeps its own cache, and an answer cached there would keep
replaying after an operator deleted its record. The admin API drops the entry locally and
writes the record key to ``cache_invalidations``; every process polls the table every
``interval`` seconds and drops what it has not seen yet. So within ``interval`` plus one
query after the admin call returns, no worker replays the old answer. A process that cannot
read the table drops its whole cache instead: it cannot know what it missed.

One clock: a process finds new rows by their id (a sequence, never a time), and the store
stamps and prunes rows with the database's clock inside its statements (``now()``; on SQLite
its own clock, which every process on the file's machine shares). A gateway whose host clock is
off by any amount therefore neither misses a delete nor prunes rows others have not read.

Ids are handed out when an insert starts, not when it commits: two deletes at once can commit
with the higher id first, and a poll between the two commits would step past the lower one.
So each poll also re-reads the rows of the last ``LATE_COMMIT_GRACE`` (by the database's
clock) and applies any it had not read before.
"""

from __future__ import annotations

import logging
from datetime import timedelta

from idempotency_gateway.replay.cache import ReplayCache
from idempotency_gateway.resilience.periodic import repeat
from idempotency_gateway.storage.base import RecordStore
from idempotency_gateway.storage.records import RecordKey
from idempotency_gateway.telemetry.degradation import DegradationLog

log = logging.getLogger(__name__)

POLL_INTERVAL = 1.0
# Far longer than any process goes between polls: older rows have been seen by everyone alive.
RETENTION = timedelta(minutes=10)
# Far longer than an insert of one row takes to commit after taking its id.
LATE_COMMIT_GRACE = timedelta(seconds=30)


class CacheInvalidations:
    def __init__(
        self,
        store: RecordStore,
        cache: ReplayCache,
        *,
        interval: float = POLL_INTERVAL,
    ) -> None:
        self.store = store
        self.cache = cache
        self.interval = interval
        self._seen: int | None = None
        # The ids the last poll read: a row among the recent ones that is not here committed
        # after a newer id was read.
        self._recent: set[int] = set()
        self.degradation = DegradationLog(
            "cache invalidations (database)", fallback="dropping the whole replay cache"
        )

    async def publish(self, key: RecordKey) -> None:
        """Tell every process to drop ``key``; this process drops it at once."""
        self.cache.invalidate([key])
        await self.store.publish_invalidation(key)

    async def poll_once(self) -> None:
        if self._seen is None:
            # A starting process has nothing cached: only later invalidations concern it.
            self._seen, self._recent = await self.store.newest_invalidations(
                within=LATE_COMMIT_GRACE
            )
            return
        rows = await self.store.invalidations_after(
            self._seen, within=LATE_COMMIT_GRACE, keep=RETENTION
        )
        unread = [row for row in rows if row.id not in self._recent]
        self._recent = {row.id for row in rows}
        if unread:
            self.cache.invalidate(row.key for row in unread)
        if rows:
            self._seen = max(self._seen, rows[-1].id)

    async def run(self) -> None:
        # A failed poll cannot know what it missed: the whole per-process cache goes.
        await repeat(
            self.poll_once,
            every=self.interval,
            degradation=self.degradation,
            on_failure=self.cache.clear,
        )
