"""The OpenTelemetry side of ``telemetry.tracing``: imported only when tracing is on.

One ``TracerProvider`` of this process's own (never OpenTelemetry's global one, so a library
user's tracing setup is left alone), W3C Trace Context in and out (``traceparent`` and
``tracestate``, nothing else), parent-based sampling at ``sample_ratio``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from opentelemetry import context, trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from idempotency_gateway.asgi import Headers, Scope
from idempotency_gateway.config import TracingConfig
from idempotency_gateway.telemetry.attributes import AttributeValue

DEFAULT_SERVICE_NAME = "idempotency-gateway"
_TRACE_HEADERS = (b"traceparent", b"tracestate")
_propagator = TraceContextTextMapPropagator()


class OtelSpan:
    __slots__ = ("_span", "_token")

    def __init__(self, span: trace.Span, parent: context.Context | None = None) -> None:
        self._span = span
        self._token = context.attach(trace.set_span_in_context(span, parent))

    def set(self, name: str, value: AttributeValue) -> None:
        self._span.set_attribute(name, value)

    def event(self, name: str, attributes: Mapping[str, AttributeValue]) -> None:
        self._span.add_event(name, attributes)

    def rename(self, name: str) -> None:
        self._span.update_name(name)

    def fail(self, error: BaseException | str) -> None:
        if isinstance(error, str):
            self._span.set_status(Status(StatusCode.ERROR, error))
            return
        self._span.record_exception(error)
        self._span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))

    def inject(self, headers: Headers) -> None:
        carrier: dict[str, str] = {}
        _propagator.inject(carrier, context=trace.set_span_in_context(self._span))
        headers[:] = [pair for pair in headers if pair[0] not in _TRACE_HEADERS]
        headers.extend((name.encode(), value.encode()) for name, value in carrier.items())

    def end(self) -> None:
        context.detach(self._token)
        self._span.end()


def _resource(config: TracingConfig) -> Resource:
    if config.service_name is not None:
        return Resource.create({SERVICE_NAME: config.service_name})
    if os.environ.get("OTEL_SERVICE_NAME"):
        return Resource.create()  # reads OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES
    return Resource.create({SERVICE_NAME: DEFAULT_SERVICE_NAME})


class OtelTracer:
    def __init__(self, config: TracingConfig, span_processor: SpanProcessor | None) -> None:
        self._provider = TracerProvider(
            resource=_resource(config),
            sampler=ParentBased(TraceIdRatioBased(config.sample_ratio)),
        )
        self._provider.add_span_processor(
            span_processor if span_processor is not None else BatchSpanProcessor(OTLPSpanExporter())
        )
        self._tracer = self._provider.get_tracer("idempotency_gateway")

    def request(self, scope: Scope) -> OtelSpan:
        carrier = {
            name.decode("latin-1"): value.decode("latin-1")
            for name, value in scope["headers"]
            if name in _TRACE_HEADERS
        }
        parent = _propagator.extract(carrier) if carrier else None
        span = self._tracer.start_span(
            scope["method"],
            context=parent,
            kind=SpanKind.SERVER,
            attributes={"http.request.method": scope["method"], "url.path": scope["path"]},
        )
        return OtelSpan(span, parent)

    def client(self, name: str, attributes: Mapping[str, AttributeValue]) -> OtelSpan | None:
        if not trace.get_current_span().is_recording():
            return None  # outside a recorded request: a background loop, or sampled out
        return OtelSpan(self._tracer.start_span(name, kind=SpanKind.CLIENT, attributes=attributes))

    def shutdown(self) -> None:
        self._provider.shutdown()
