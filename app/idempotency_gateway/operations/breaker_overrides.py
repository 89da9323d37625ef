"""Operator-forced breaker states, shared by every gateway process through the database.

Breakers live in each process; an operator forcing one open means the whole fleet. The admin
API writes the override to ``breaker_overrides`` and applies it locally at once; every other
process picks it up on its next sync (every ``interval`` seconds).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from datetime import datetime

from idempotency_gateway.resilience.breaker import BreakerState, CircuitBreaker
from idempotency_gateway.resilience.periodic import repeat
from idempotency_gateway.storage.base import RecordStore
from idempotency_gateway.telemetry.degradation import DegradationLog

log = logging.getLogger(__name__)

SYNC_INTERVAL = 2.0


class BreakerOverrides:
    def __init__(
        self,
        store: RecordStore,
        breakers: Mapping[str, CircuitBreaker],
        *,
        clock: Callable[[], datetime],
        interval: float = SYNC_INTERVAL,
    ) -> None:
        self.store = store
        self.breakers = breakers
        self.interval = interval
        self._clock = clock
        self._applied: dict[str, BreakerState | None] = dict.fromkeys(breakers)
        self.degradation = DegradationLog(
            "breaker overrides (database)", fallback="keeping the overrides in force"
        )

    def override_of(self, upstream: str) -> BreakerState | None:
        return self._applied.get(upstream)

    async def set(self, upstream: str, state: BreakerState | None) -> None:
        """Force ``upstream``'s breaker fleet-wide (``None``: back to normal operation)."""
        await self.store.set_breaker_override(
            upstream, None if state is None else state.value, self._clock()
        )
        self._apply(upstream, state)

    async def sync_once(self) -> None:
        overrides = await self.store.breaker_overrides()
        wanted = {upstream: BreakerState(state) for upstream, state in overrides.items()}
        for upstream in self.breakers:
            self._apply(upstream, wanted.get(upstream))

    def _apply(self, upstream: str, state: BreakerState | None) -> None:
        if upstream not in self.breakers or self._applied.get(upstream) == state:
            return
        log.warning(
            "breaker override for upstream %s: %s", upstream, state.value if state else "none"
        )
        self.breakers[upstream].force(state)
        self._applied[upstream] = state

    async def run(self) -> None:
        await repeat(self.sync_once, every=self.interval, degradation=self.degradation)
