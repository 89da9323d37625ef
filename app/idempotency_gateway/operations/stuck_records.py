"""The ``stuck_records`` gauge: ``IN_PROGRESS`` records whose owner's lease ran out.

Sampled by one background task per worker, not per scrape: a scrape must never wait on the
database, and a count every ``every`` seconds (capped by ``limit``, so a pile-up costs no
more than a bounded index scan) is cheap next to the traffic.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from idempotency_gateway.errors import StoreUnavailable
from idempotency_gateway.resilience.periodic import repeat
from idempotency_gateway.telemetry.degradation import DegradationLog
from idempotency_gateway.telemetry.metrics import STUCK_RECORDS

SAMPLE_EVERY = 15.0
COUNT_LIMIT = 1000

CountStuck = Callable[..., Awaitable[int]]


class StuckRecordsSampler:
    def __init__(
        self, count_stuck: CountStuck, *, every: float = SAMPLE_EVERY, limit: int = COUNT_LIMIT
    ) -> None:
        self._count_stuck = count_stuck
        self.every = every
        self.limit = limit
        self.degradation = DegradationLog(
            "stuck-record count", fallback="stuck_records keeps its last sample"
        )

    async def sample(self) -> None:
        try:
            await self._sample()
        except StoreUnavailable as exc:
            self.degradation.failed(exc)

    async def _sample(self) -> None:
        STUCK_RECORDS.set(await self._count_stuck(limit=self.limit))

    async def run(self) -> None:
        await repeat(self._sample, every=self.every, degradation=self.degradation)
