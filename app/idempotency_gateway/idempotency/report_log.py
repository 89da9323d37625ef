"""The one place the idempotency layer's report reaches the request log and the metrics.

The engine and the middleware fill a ``Report`` (``report.py``); the middleware hands it here
once, when its part of the request is done.
"""

from __future__ import annotations

from idempotency_gateway.asgi import Scope
from idempotency_gateway.idempotency.keys import key_hash
from idempotency_gateway.idempotency.report import Report, Verdict
from idempotency_gateway.telemetry.metrics import TAKEOVERS
from idempotency_gateway.telemetry.request_log import RequestOutcome, request_log_of

_OUTCOMES = {
    Verdict.EXECUTED: RequestOutcome.EXECUTED,
    Verdict.NOT_EXECUTED: RequestOutcome.NOT_EXECUTED,
    Verdict.REPLAYED: RequestOutcome.REPLAYED,
    Verdict.CONFLICT_IN_FLIGHT: RequestOutcome.CONFLICT_IN_FLIGHT,
    Verdict.MISMATCH: RequestOutcome.MISMATCH,
    Verdict.REJECTED: RequestOutcome.REJECTED,
    Verdict.STORE_UNAVAILABLE: RequestOutcome.STORE_UNAVAILABLE,
    Verdict.PASSED_THROUGH: RequestOutcome.STORE_DOWN_PASSED_THROUGH,
    Verdict.OUTCOME_UNKNOWN: RequestOutcome.OUTCOME_UNKNOWN,
}


def note_report(scope: Scope, report: Report) -> None:
    """The one place the idempotency layer's work reaches the request log and the metrics;
    what the report leaves unsaid, layers outside or inside (a shed request, a route the
    proxy names) keep."""
    if report.takeover is not None:
        TAKEOVERS.labels(report.takeover).inc()
    entry = request_log_of(scope)
    if entry is None:
        return
    if report.route is not None:
        entry.route = report.route
    if report.key is not None:
        entry.scope_hash = report.key.tenant
        entry.key_hash = key_hash(report.key.idempotency_key)
    if report.verdict is not None:
        entry.outcome = _OUTCOMES[report.verdict]
