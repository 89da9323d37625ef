"""Admin deletes and expiries reach every process's in-process replay cache.

Without Redis each worker keeps its own cache, and an answer cached there would keep
replaying after an operator deleted its record. The admin API drops the entry locally and
writes the record key to ``cache_invalidations``; every process polls the table every
``interval`` seconds and drops what it has not seen yet. So within ``interval`` plus one
query after the admin call returns, no worker replays the old answer. A process that cannot
read the table drops its whole cache instead: it cannot know what it missed.

One clock: a process finds new rows by their id (a sequence, never a time), and rows are
stamped and pruned with the database's clock inside the statements (``now()``; on SQLite its
own clock, which every process on the file's machine shares). A gateway whose host clock is
off by any amount therefore neither misses a delete nor prunes rows others have not read.

Ids are handed out when an insert starts, not when it commits: two deletes at once can commit
with the higher id first, and a poll between the two commits would step past the lower one.
So each poll also re-reads the rows of the last ``LATE_COMMIT_GRACE`` (by the database's
clock) and applies any it had not read before.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

from sqlalchemy import ColumnElement, delete, func, insert, or_, select
from sqlalchemy.ext.asyncio import AsyncEngine

from idempotency_gateway.replay.cache import ReplayCache
from idempotency_gateway.resilience.periodic import repeat
from idempotency_gateway.storage.base import store_connection
from idempotency_gateway.storage.records import RecordKey
from idempotency_gateway.storage.schema import cache_invalidations
from idempotency_gateway.telemetry.degradation import DegradationLog

log = logging.getLogger(__name__)

POLL_INTERVAL = 1.0
# Far longer than any process goes between polls: older rows have been seen by everyone alive.
RETENTION = timedelta(minutes=10)
# Far longer than an insert of one row takes to commit after taking its id.
LATE_COMMIT_GRACE = timedelta(seconds=30)

_table = cache_invalidations.c
# SQLite keeps times as the text SQLAlchemy's ``DateTime`` writes; this is its clock in a
# form that orders the same way.
_SQLITE_TIME = "%Y-%m-%d %H:%M:%f"


def database_time(engine: AsyncEngine, *, ago: timedelta = timedelta()) -> ColumnElement[Any]:
    """The database's "now" (minus ``ago``) inside a statement, never a gateway host's."""
    if engine.dialect.name == "sqlite":
        return func.strftime(_SQLITE_TIME, "now", f"-{ago.total_seconds():f} seconds")
    return func.now() - ago if ago else func.now()


class CacheInvalidations:
    def __init__(
        self,
        engine: AsyncEngine,
        cache: ReplayCache,
        *,
        interval: float = POLL_INTERVAL,
    ) -> None:
        self.engine = engine
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
        async with store_connection(self.engine, "invalidation_publish") as connection:
            await connection.execute(
                insert(cache_invalidations).values(
                    scope=key.scope,
                    operation=key.operation,
                    idempotency_key=key.idempotency_key,
                    created_at=database_time(self.engine),
                )
            )

    async def poll_once(self) -> None:
        async with (
            store_connection(self.engine, "invalidation_poll") as connection,
            connection.begin(),
        ):
            recent = _table.created_at > database_time(self.engine, ago=LATE_COMMIT_GRACE)
            if self._seen is None:
                # A starting process has nothing cached: only later invalidations concern it.
                newest = (await connection.execute(select(func.max(_table.id)))).scalar()
                self._seen = newest or 0
                self._recent = set(
                    (await connection.execute(select(_table.id).where(recent))).scalars()
                )
                return
            rows = (
                await connection.execute(
                    select(_table.id, _table.scope, _table.operation, _table.idempotency_key)
                    .where(or_(_table.id > self._seen, recent))
                    .order_by(_table.id)
                )
            ).all()
            await connection.execute(
                delete(cache_invalidations).where(
                    _table.created_at < database_time(self.engine, ago=RETENTION)
                )
            )
        unread = [row for row in rows if row.id not in self._recent]
        self._recent = {row.id for row in rows}
        if unread:
            self.cache.invalidate(
                RecordKey(row.scope, row.operation, row.idempotency_key) for row in unread
            )
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
