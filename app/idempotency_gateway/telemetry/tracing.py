"""The tracing hooks: free until ``enable``, and no OpenTelemetry import until then.

The places that do one kind of work each ask for their span here (the request in
``AccessLogMiddleware``, each store statement in ``store_errors``, each Redis cache call in
``RedisCache._guarded``, each upstream attempt in ``ResilientUpstream``). Off, every hook is a
call that returns ``None`` and the caller's ``is not None`` check skips the rest; on, the spans
come from ``telemetry.otel`` (the ``tracing`` extra), imported by ``enable`` alone.
Store, cache and attempt spans exist only inside a recorded request span: background loops
(sweeper, breaker overrides, health checks) and requests sampled out cost nothing more.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

from idempotency_gateway.asgi import Headers, Scope
from idempotency_gateway.config import TracingConfig
from idempotency_gateway.telemetry.attributes import AttributeValue

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import SpanProcessor


class Span(Protocol):
    """One span, current (the parent of spans started under it) until ``end``."""

    def set(self, name: str, value: AttributeValue) -> None: ...

    def event(self, name: str, attributes: Mapping[str, AttributeValue]) -> None: ...

    def rename(self, name: str) -> None: ...

    def fail(self, error: BaseException | str) -> None:
        """Mark the span failed: by an exception (recorded as an event), or as described."""

    def inject(self, headers: Headers) -> None:
        """Put this span's ``traceparent`` (and ``tracestate``) into ``headers``, replacing
        any the client sent: the upstream's spans become this span's children."""

    def end(self) -> None: ...


class Tracer(Protocol):
    def request(self, scope: Scope) -> Span: ...

    # Store, cache and upstream calls: client spans under the current one.
    def client(self, name: str, attributes: Mapping[str, AttributeValue]) -> Span | None: ...

    def shutdown(self) -> None: ...


_tracer: Tracer | None = None


def enable(config: TracingConfig, *, span_processor: SpanProcessor | None = None) -> None:
    """Start tracing in this process: spans go to ``span_processor``, by default a batch
    exporter of OTLP over HTTP configured by the ``OTEL_EXPORTER_OTLP_*`` variables."""
    global _tracer
    # Here and only here: a gateway without tracing never loads OpenTelemetry.
    from idempotency_gateway.telemetry.otel import OtelTracer

    disable()
    _tracer = OtelTracer(config, span_processor)


def disable() -> None:
    """Stop tracing; spans not yet exported are flushed first."""
    global _tracer
    if _tracer is not None:
        _tracer.shutdown()
        _tracer = None


def request_span(scope: Scope) -> Span | None:
    """The gateway request's server span, continuing the caller's ``traceparent``."""
    return None if _tracer is None else _tracer.request(scope)


def store_span(operation: str, system: str) -> Span | None:
    """One store statement: ``reserve``, ``take_over``, ``renew_lease``, ``finalize``..."""
    if _tracer is None:
        return None
    return _tracer.client(f"store {operation}", {"db.system": system, "db.operation": operation})


def cache_span(operation: str) -> Span | None:
    """One call to the shared replay cache (Redis): ``get``, ``put``, ``delete``."""
    if _tracer is None:
        return None
    return _tracer.client(f"cache {operation}", {"db.system": "redis", "db.operation": operation})


def attempt_span(upstream: str, attempt: int) -> Span | None:
    """One attempt at the upstream: a client span, with the breaker's and the retry loop's
    decisions as its events."""
    if _tracer is None:
        return None
    return _tracer.client(
        f"upstream {upstream}", {"gateway.upstream": upstream, "gateway.attempt": attempt}
    )
