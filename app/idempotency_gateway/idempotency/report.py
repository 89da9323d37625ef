"""What the idempotency layer did with one request, for the middleware to log and count.

The engine and the middleware only fill a ``Report``; the middleware hands it to the request
log and the metrics once, when its part of the request is done. So the domain never writes a
log field or a metric itself, and every outcome is noted in one place.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, auto

from idempotency_gateway.errors import (
    GatewayError,
    KeyReusedWithDifferentRequest,
    RequestInFlight,
    RequestRejected,
    StoreUnavailable,
)
from idempotency_gateway.storage.records import RecordKey


class Verdict(Enum):
    EXECUTED = auto()
    # Nothing reached the upstream: the gateway's own 5xx, and a retry with the key runs again.
    NOT_EXECUTED = auto()
    REPLAYED = auto()
    CONFLICT_IN_FLIGHT = auto()
    MISMATCH = auto()
    REJECTED = auto()
    STORE_UNAVAILABLE = auto()
    # The store was down and the route fails open: proxied with no idempotency protection.
    PASSED_THROUGH = auto()
    OUTCOME_UNKNOWN = auto()


def verdict_of(error: GatewayError) -> Verdict | None:
    """The verdict a refusal stands for; ``None`` for one that says nothing about the key
    (a full bulkhead, noted where it refused)."""
    if isinstance(error, KeyReusedWithDifferentRequest):
        return Verdict.MISMATCH
    if isinstance(error, RequestInFlight):
        return Verdict.CONFLICT_IN_FLIGHT
    if isinstance(error, RequestRejected):
        return Verdict.REJECTED
    if isinstance(error, StoreUnavailable):
        return Verdict.STORE_UNAVAILABLE
    return None


@dataclass(slots=True)
class Report:
    route: str | None = None
    key: RecordKey | None = None
    verdict: Verdict | None = None
    takeover: str | None = None
    """Why the record was taken over from an earlier owner (``expired``, ``retryable``,
    ``abandoned``), when it was."""

    def refused(self, error: GatewayError) -> None:
        """A refusal decides the verdict unless one was reached before it: an error the app
        raised after it executed leaves the request executed."""
        if self.verdict is None:
            self.verdict = verdict_of(error)
