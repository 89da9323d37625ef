"""One request id, one structured log line and one set of metrics per request.

``AccessLogMiddleware`` is the outermost layer: it gives the request its ``X-Request-Id``
(echoed on the response and set as the log context's request id), puts a ``RequestLog`` into
the ASGI scope, the layers below fill in what they learn (route, upstream, idempotency
outcome, attempts, scope hash), and when the response ends it writes the log line and the
request metrics; a failure no layer expected becomes a 500 problem here. Never a credential,
a key or a body: the scope is its hash, the path is logged but never a metric label.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from enum import StrEnum

from idempotency_gateway.asgi import ASGIApp, Message, Receive, Scope, Send
from idempotency_gateway.errors import UnexpectedError
from idempotency_gateway.problems import send_problem
from idempotency_gateway.request_id import REQUEST_ID_HEADER, ensure_request_id
from idempotency_gateway.telemetry import tracing
from idempotency_gateway.telemetry.iteration_metrics import counts, observations
from idempotency_gateway.telemetry.logs import current_request_id
from idempotency_gateway.telemetry.metrics import REQUEST_DURATION, REQUESTS

log = logging.getLogger("idempotency_gateway.access")
_log = logging.getLogger(__name__)

STATE_KEY = "request_log"


class RequestOutcome(StrEnum):
    """What the gateway did with a request: the ``outcome`` label and log field. An enum so
    a misspelt outcome fails type checking instead of starting a new time series."""

    EXECUTED = "executed"
    # Never reached the upstream (circuit open, connection refused, lease not confirmed):
    # the gateway answered 5xx itself, and a retry with the key runs again.
    NOT_EXECUTED = "not_executed"
    REPLAYED = "replayed"
    CONFLICT_IN_FLIGHT = "conflict_in_flight"
    MISMATCH = "mismatch"
    REJECTED = "rejected"
    STORE_UNAVAILABLE = "store_unavailable"
    # The store was down and the route fails open: proxied with no idempotency protection.
    STORE_DOWN_PASSED_THROUGH = "store_down_passed_through"
    OUTCOME_UNKNOWN = "outcome_unknown"
    # A bulkhead had no room: refused with capacity-exhausted before anything ran.
    SHED = "shed"
    UNPROTECTED = "unprotected"


# Not slotted: orjson writes a dataclass with an instance ``__dict__`` straight from it and
# one with ``__slots__`` field by field, 1.1 against 0.3 us per access line (timeit).
@dataclass
class RequestLog:
    request_id: str | None
    method: str
    path: str
    route: str = "-"
    upstream: str | None = None
    outcome: RequestOutcome = RequestOutcome.UNPROTECTED
    attempts: int = 0
    status: int | None = None
    scope_hash: str | None = None
    key_hash: str | None = None
    duration_ms: float = 0.0


def request_log_of(scope: Scope) -> RequestLog | None:
    entry = scope.get("state", {}).get(STATE_KEY)
    return entry if isinstance(entry, RequestLog) else None


def note_outcome(scope: Scope, outcome: RequestOutcome) -> None:
    entry = request_log_of(scope)
    if entry is not None:
        entry.outcome = outcome


def status_class(status: int | None) -> str:
    """``2xx`` .. ``5xx``; ``none`` when no response head went out (client gone first)."""
    return "none" if status is None else f"{status // 100}xx"


_requests = counts(REQUESTS)
_durations = observations(REQUEST_DURATION)


class AccessLogMiddleware:
    """``render_failures``: a failure no layer expected becomes a 500 problem here (the
    gateway); ``False`` leaves it to the layers outside (an app's own server error handler),
    counted as a 500."""

    def __init__(self, app: ASGIApp, *, render_failures: bool = True) -> None:
        self.app = app
        self.render_failures = render_failures

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = ensure_request_id(scope)
        entry = RequestLog(request_id.decode("ascii"), scope["method"], scope["path"])
        scope.setdefault("state", {})[STATE_KEY] = entry
        context = current_request_id.set(entry.request_id)
        span = tracing.request_span(scope)
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
        except Exception:
            if entry.status is not None:
                raise  # a head went out: nothing can replace it, the answer is cut short
            if not self.render_failures:
                entry.status = 500
                raise
            # Outermost layer: a failure no layer expected becomes a problem like any other,
            # never the server's plain-text page.
            _log.exception("unexpected error while handling a request")
            error = UnexpectedError("the gateway failed unexpectedly; the failure is logged")
            await send_problem(send_noting_status, error, request_id=entry.request_id)
        finally:
            elapsed = time.perf_counter() - started
            entry.duration_ms = round(elapsed * 1000, 3)
            _requests(entry.route, entry.outcome, status_class(entry.status)).inc()
            _durations(entry.route, entry.outcome).observe(elapsed)
            write_access_line(entry)
            if span is not None:
                end_request_span(span, entry)
            current_request_id.reset(context)


def end_request_span(span: tracing.Span, entry: RequestLog) -> None:
    """What the log line says, on the request's span: route, outcome, status, attempts."""
    span.rename(f"{entry.method} {entry.route}")
    span.set("http.route", entry.route)
    span.set("gateway.outcome", entry.outcome.value)
    span.set("gateway.attempts", entry.attempts)
    if entry.upstream is not None:
        span.set("gateway.upstream", entry.upstream)
    if entry.status is not None:
        span.set("http.response.status_code", entry.status)
        if entry.status >= 500:
            span.fail(f"answered {entry.status}")
    span.end()


# Logger name, level, origin (file, line), message, arguments, exception.
_ACCESS_LINE = (log.name, logging.INFO, __file__, 0, "request", (), None)


def write_access_line(entry: RequestLog) -> None:
    """``log.info("request", extra={"request": entry})``, on a record copied from this
    thread's template: a real ``LogRecord`` for every handler and filter, without the stack
    walk for the caller's file and line (always this function) and the dozen lookups
    ``LogRecord.__init__`` repeats for every line (a third of its cost, measured)."""
    if not log.isEnabledFor(logging.INFO):
        return
    if logging.getLogRecordFactory() is not logging.LogRecord:
        # A factory of the application's own (OpenTelemetry's log correlation is one) puts
        # values of the moment on each record: it must build every one.
        log.handle(log.makeRecord(*_ACCESS_LINE, extra={"request": entry}))
        return
    log.handle(_records.access_record(entry))


class _AccessRecords(threading.local):
    """Per thread: the access line's record with everything that stays the same filled in
    (logger, level, message, origin, process, thread), built by ``LogRecord`` itself."""

    def __init__(self) -> None:
        template = logging.LogRecord(*_ACCESS_LINE)
        self.fields = dict(vars(template))
        # ``relativeCreated`` counts from when logging started.
        self.logging_started = template.created - template.relativeCreated / 1000

    def access_record(self, entry: RequestLog) -> logging.LogRecord:
        record = logging.LogRecord.__new__(logging.LogRecord)
        fields = record.__dict__
        fields.update(self.fields)
        created = time.time()
        fields["created"] = created
        fields["msecs"] = int((created - int(created)) * 1000) + 0.0
        fields["relativeCreated"] = (created - self.logging_started) * 1000
        fields["request"] = entry
        return record


_records = _AccessRecords()


def _forget_parent_records() -> None:
    global _records  # a forked child's records must carry its own process id
    _records = _AccessRecords()


os.register_at_fork(after_in_child=_forget_parent_records)
