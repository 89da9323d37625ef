"""CPU tracing adds to a keyed request, off and on: ``tracing_cpu``.

    .venv/bin/python -m benchmarks.tracing_cpu

Calls ``AccessLogMiddleware`` around a constant-answer ASGI app directly (no sockets) and
reports ``time.process_time`` per request in four set-ups: the app opens no spans (the floor);
the app calls the hooks a keyed request calls (cache get, reserve, one upstream attempt with
its traceparent, finalize, cache put) with tracing off; tracing on with ``sample_ratio: 0``;
and tracing on at 1.0 with every span exported to an exporter that drops it. The ``on`` rows
need the ``tracing`` extra. The access log line is silenced in every row alike.
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Sequence
from typing import Any

from idempotency_gateway.asgi import Headers


async def _answer(scope: Any, receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 201, "headers": []})
    await send({"type": "http.response.body", "body": b"{}", "more_body": False})


async def _keyed(scope: Any, receive: Any, send: Any) -> None:
    """The spans of a keyed request that executes once, opened by the gateway's own hooks."""
    from idempotency_gateway.telemetry import tracing

    for span in (tracing.cache_span("get"), tracing.store_span("reserve", "postgresql")):
        if span is not None:
            span.end()
    attempt = tracing.attempt_span("primary", 1)
    if attempt is not None:
        headers: Headers = []
        attempt.inject(headers)
        attempt.set("http.response.status_code", 201)
        attempt.event("breaker.verdict", {"gateway.failure": False})
        attempt.end()
    for span in (tracing.store_span("finalize", "postgresql"), tracing.cache_span("put")):
        if span is not None:
            span.end()
    await _answer(scope, receive, send)


async def cpu_per_request(requests: int) -> dict[str, float]:
    """Seconds of CPU per request, by set-up."""
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult

    from idempotency_gateway.config import TracingConfig
    from idempotency_gateway.telemetry import tracing
    from idempotency_gateway.telemetry.request_log import AccessLogMiddleware

    class Drop(SpanExporter):
        def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Any) -> None:
        return None

    async def run(app: Any, count: int) -> float:
        started = time.process_time()
        for _ in range(count):
            scope = {"type": "http", "method": "POST", "path": "/v1/charges", "headers": []}
            await app(scope, receive, send)
        return (time.process_time() - started) / count

    setups: dict[str, tuple[Any, TracingConfig | None]] = {
        "no spans opened": (AccessLogMiddleware(_answer), None),
        "tracing off": (AccessLogMiddleware(_keyed), None),
        "on, sample_ratio 0": (
            AccessLogMiddleware(_keyed),
            TracingConfig(enabled=True, sample_ratio=0.0),
        ),
        "on, sample_ratio 1": (
            AccessLogMiddleware(_keyed),
            TracingConfig(enabled=True, sample_ratio=1.0),
        ),
    }
    best: dict[str, float] = {}
    for _ in range(5):
        for name, (app, config) in setups.items():
            if config is not None:
                tracing.enable(config, span_processor=SimpleSpanProcessor(Drop()))
            try:
                await run(app, min(1000, requests))
                spent = await run(app, requests)
            finally:
                tracing.disable()
            best[name] = min(spent, best.get(name, spent))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tracing_cpu")
    parser.add_argument("--requests", type=int, default=20_000)
    args = parser.parse_args()
    logging.getLogger("idempotency_gateway.access").disabled = True
    from benchmarks.runloop import loop_name, run_fast

    best = run_fast(cpu_per_request(args.requests))
    floor = best["no spans opened"]
    print(f"{loop_name()}, best of 5 x {args.requests} requests, CPU per request:")
    for name, spent in best.items():
        print(f"  {name:<20} {spent * 1e6:8.2f} us  (+{(spent - floor) * 1e6:.2f} us)")


if __name__ == "__main__":
    main()
