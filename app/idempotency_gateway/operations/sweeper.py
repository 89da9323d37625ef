"""The background sweeper: deletes expired records every ``interval``, in bounded batches.

Each gateway process runs one; on PostgreSQL an advisory lock lets only one of them sweep at a
time, so a fleet of gateways does the work once, not N times.
"""

from __future__ import annotations

import logging

from idempotency_gateway.config import SweeperConfig
from idempotency_gateway.resilience.periodic import repeat
from idempotency_gateway.storage.base import RecordStore
from idempotency_gateway.telemetry.degradation import DegradationLog
from idempotency_gateway.telemetry.metrics import SWEPT_RECORDS

log = logging.getLogger(__name__)


class Sweeper:
    def __init__(self, store: RecordStore, config: SweeperConfig) -> None:
        self.store = store
        self.config = config
        self.degradation = DegradationLog(
            "the sweeper's store", fallback="expired records wait for the next sweep"
        )

    async def sweep_once(self) -> int | None:
        deleted = await self.store.sweep(batch_size=self.config.batch_size)
        if deleted:
            SWEPT_RECORDS.inc(deleted)
            log.info("swept %d expired records", deleted)
        return deleted

    async def run(self) -> None:
        await repeat(
            self.sweep_once,
            every=self.config.interval,
            degradation=self.degradation,
            wait_first=True,
        )
