"""A request's total time budget, shared by every attempt and forwarded upstream."""

from __future__ import annotations

from idempotency_gateway.asgi import Headers, first_header
from idempotency_gateway.clock import Monotonic, monotonic

REQUEST_TIMEOUT_HEADER = b"x-request-timeout"


class Deadline:
    def __init__(self, budget: float, *, clock: Monotonic = monotonic) -> None:
        self._clock = clock
        self._ends_at = clock() + budget

    @classmethod
    def for_request(
        cls, headers: Headers, total: float, *, clock: Monotonic = monotonic
    ) -> Deadline:
        """The route's total timeout, shortened by the client's ``X-Request-Timeout``."""
        budget = total
        asked = first_header(headers, REQUEST_TIMEOUT_HEADER)
        if asked is not None:
            try:
                client_budget = float(asked)
            except ValueError:
                client_budget = total
            if 0 < client_budget < budget:
                budget = client_budget
        return cls(budget, clock=clock)

    def remaining(self) -> float:
        return max(0.0, self._ends_at - self._clock())
