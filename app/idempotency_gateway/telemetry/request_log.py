"""One request id, one structured log line and one set of metrics per request.

``AccessLogMiddleware`` is the outermost layer: it gives the request its ``X-Request-Id``
(echoed on the response), puts a ``RequestLog`` into the ASGI scope,
the layers below fill in what they learn (route, upstream, idempotency outcome, attempts,
scope hash), and when the response ends it writes the log line and the request metrics.
Never a credential, a key or a body: the scope is its hash, the path is logged but never a
metric label.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass

from idempotency_gateway.asgi import ASGIApp, Message, Receive, Scope, Send
from idempotency_gateway.request_id import REQUEST_ID_HEADER, ensure_request_id
from idempotency_gateway.telemetry.metrics import REQUEST_DURATION, REQUESTS

log = logging.getLogger("idempotency_gateway.access")

STATE_KEY = "request_log"


@dataclass(slots=True)
class RequestLog:
    request_id: str | None
    method: str
    path: str
    route: str = "-"
    upstream: str | None = None
    # executed | replayed | conflict_in_flight | mismatch | rejected | store_unavailable |
    # outcome_unknown | unprotected
    outcome: str = "unprotected"
    attempts: int = 0
    status: int | None = None
    scope_hash: str | None = None
    duration_ms: float = 0.0


def request_log_of(scope: Scope) -> RequestLog | None:
    entry = scope.get("state", {}).get(STATE_KEY)
    return entry if isinstance(entry, RequestLog) else None


def note_outcome(scope: Scope, outcome: str) -> None:
    entry = request_log_of(scope)
    if entry is not None:
        entry.outcome = outcome


class AccessLogMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = ensure_request_id(scope)
        entry = RequestLog(request_id.decode("ascii"), scope["method"], scope["path"])
        scope.setdefault("state", {})[STATE_KEY] = entry
        started = time.perf_counter()

        async def send_noting_status(message: Message) -> None:
            if message["type"] == "http.response.start":
                entry.status = message["status"]
                headers = [
                    pair for pair in message.get("headers", []) if pair[0] != REQUEST_ID_HEADER
                ]
                headers.append((REQUEST_ID_HEADER, request_id))
                message["headers"] = headers
            await send(message)

        try:
            await self.app(scope, receive, send_noting_status)
        finally:
            elapsed = time.perf_counter() - started
            entry.duration_ms = round(elapsed * 1000, 3)
            REQUESTS.labels(entry.route, entry.outcome).inc()
            REQUEST_DURATION.labels(entry.route, entry.outcome).observe(elapsed)
            if log.isEnabledFor(logging.INFO):
                log.info("request", extra={"request": asdict(entry)})
