"""A retry budget per upstream, after Finagle's ``RetryBudget`` and gRPC's retry throttling.

Retries may add at most ``ratio`` of the requests seen over the last ``window`` seconds, plus
``min_per_second`` so a quiet upstream can still be retried. When an upstream degrades, every
client retrying independently multiplies its load; a budget caps that multiplication at
``1 + ratio``.
"""

from __future__ import annotations

from idempotency_gateway.clock import Monotonic, monotonic
from idempotency_gateway.resilience.window import SlidingCounter


class RetryBudget:
    def __init__(
        self,
        *,
        ratio: float,
        min_per_second: float,
        window: float = 10.0,
        clock: Monotonic = monotonic,
    ) -> None:
        self.ratio = ratio
        self.min_per_second = min_per_second
        self.window = window
        self._requests = SlidingCounter(window, clock=clock)
        self._retries = SlidingCounter(window, clock=clock)

    def record_request(self) -> None:
        self._requests.add()

    def try_withdraw(self) -> bool:
        """Spend one retry if the budget allows it."""
        allowance = self.min_per_second * self.window + self.ratio * self._requests.total()
        if self._retries.total() + 1 > allowance:
            return False
        self._retries.add()
        return True
