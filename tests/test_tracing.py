"""OpenTelemetry spans of a real gateway, and nothing of OpenTelemetry when tracing is off.

The gateway is served in the test's loop with PostgreSQL and the Redis replay cache, its
spans caught by the SDK's ``InMemorySpanExporter`` behind a ``SimpleSpanProcessor`` (each span
exported when it ends). Proves the span tree of a keyed request whose first attempt gets a
503 and is retried (server span, store statements, cache calls, one client span per attempt
with the breaker's and the retry loop's decisions as events), that the upstream receives the
attempt's own ``traceparent`` and that a caller's ``traceparent`` is continued, that a replay
has no upstream span, that a request sampled out opens no span at all (and sends no
``traceparent``), and that a gateway with tracing off never imports OpenTelemetry.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import textwrap
import uuid
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from idempotency_gateway.config import GatewayConfig
from tests.support import RecordingUpstream, eventually
from tests.support.charges import CHARGE, CHARGES, keyed_headers
from tests.support.gateway import RunningGateway, running_gateway
from tests.support.keyed import AUTHORIZATION, is_replay, keyed_gateway_config, send_keyed

SERVICE = "gateway-under-test"
# A caller's trace: version 00, trace id, parent span id, sampled.
CALLER_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN_ID = "00f067aa0ba902b7"
CALLER_TRACEPARENT = f"00-{CALLER_TRACE_ID}-{CALLER_SPAN_ID}-01"


def traced_config(upstream_url: str, **overrides: Any) -> GatewayConfig:
    return keyed_gateway_config(
        upstream_url,
        # Two attempts, the pause between them a few milliseconds.
        retry={"max_attempts": 2, "base": "5ms", "cap": "5ms"},
        tracing={"enabled": True, "service_name": SERVICE, "sample_ratio": 1.0},
        **overrides,
    )


@contextlib.asynccontextmanager
async def traced_gateway(
    config: GatewayConfig, postgres_url: str, redis_url: str
) -> AsyncIterator[tuple[RunningGateway, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    async with running_gateway(
        config,
        database_url=postgres_url,
        redis_url=redis_url,
        span_processor=SimpleSpanProcessor(exporter),
    ) as gateway:
        yield gateway, exporter


@pytest.fixture
async def traced(
    upstream: RecordingUpstream, postgres_url: str, redis_url: str
) -> AsyncIterator[tuple[RunningGateway, InMemorySpanExporter]]:
    async with traced_gateway(traced_config(upstream.url), postgres_url, redis_url) as running:
        yield running


@pytest.fixture
async def traced_redis_only(
    upstream: RecordingUpstream, postgres_url: str, redis_url: str
) -> AsyncIterator[tuple[RunningGateway, InMemorySpanExporter]]:
    """No copies in the process (``cache.max_entries: 0``): every replay asks Redis."""
    config = traced_config(upstream.url, cache={"max_entries": 0})
    async with traced_gateway(config, postgres_url, redis_url) as running:
        yield running


def trace_id(span: ReadableSpan) -> str:
    assert span.context is not None
    return f"{span.context.trace_id:032x}"


def span_id(span: ReadableSpan) -> str:
    assert span.context is not None
    return f"{span.context.span_id:016x}"


def parent_id(span: ReadableSpan) -> str | None:
    return None if span.parent is None else f"{span.parent.span_id:016x}"


async def traces(exporter: InMemorySpanExporter, count: int) -> list[list[ReadableSpan]]:
    """The spans of the first ``count`` requests, each trace in the order its spans began,
    once every request's server span has ended (after its response went out)."""

    def server_spans() -> list[ReadableSpan] | None:
        found = [s for s in exporter.get_finished_spans() if s.kind is SpanKind.SERVER]
        return found if len(found) >= count else None

    servers = sorted(await eventually(server_spans), key=lambda s: s.start_time or 0)
    spans = exporter.get_finished_spans()
    return [
        sorted(
            (s for s in spans if trace_id(s) == trace_id(server)), key=lambda s: s.start_time or 0
        )
        for server in servers[:count]
    ]


def sent_trace(traceparent: str) -> tuple[str, str]:
    """The trace and parent span a ``traceparent`` names; it must say "sampled" too (its
    other flag bits, such as level 2's random trace id, are the SDK's business)."""
    version, trace, span, flags = traceparent.split("-")
    assert version == "00"
    assert int(flags, 16) & 1, traceparent
    return trace, span


def children(spans: Sequence[ReadableSpan], parent: ReadableSpan) -> list[ReadableSpan]:
    return [s for s in spans if parent_id(s) == span_id(parent)]


def names(spans: Sequence[ReadableSpan]) -> list[str]:
    return [s.name for s in spans]


def events(span: ReadableSpan) -> list[tuple[str, dict[str, object]]]:
    return [(event.name, dict(event.attributes or {})) for event in span.events]


def tree(spans: Sequence[ReadableSpan]) -> str:
    """The trace as docs/tracing.md shows it: one line a span, indented under its parent."""
    depth: dict[str, int] = {}
    lines = []
    for span in spans:  # in start order: a parent comes before its children
        parent = parent_id(span)
        depth[span_id(span)] = depth[parent] + 1 if parent in depth else 0
        indent = "  " * depth[span_id(span)]
        lines.append(f"{indent}{span.name} [{span.kind.name}] {dict(span.attributes or {})}")
        lines.extend(f"{indent}  event {event}" for event in events(span))
    return "\n".join(lines)


async def test_a_retried_keyed_request_is_one_trace_of_statements_cache_calls_and_attempts(
    traced: tuple[RunningGateway, InMemorySpanExporter], upstream: RecordingUpstream
) -> None:
    gateway, exporter = traced
    key = f"trace-{uuid.uuid4()}"
    response = await send_keyed(gateway.client, key, behavior="status-first=503")
    assert response.status_code == 201, response.text

    (spans,) = await traces(exporter, 1)
    print(tree(spans))  # the trace docs/tracing.md shows (pytest -s)
    server = spans[0]
    assert server.kind is SpanKind.SERVER, tree(spans)
    assert server.parent is None
    assert server.name == "POST root"
    assert server.resource.attributes["service.name"] == SERVICE
    assert dict(server.attributes or {}) == {
        "http.request.method": "POST",
        "url.path": "/v1/charges",
        "http.route": "root",
        "gateway.outcome": "executed",
        "gateway.attempts": 2,
        "gateway.upstream": "primary",
        "http.response.status_code": 201,
    }
    direct = children(spans, server)
    assert names(direct) == [
        "cache get",
        "store reserve",
        "upstream primary",
        "upstream primary",
        "store finalize",
        "cache put",
    ], tree(spans)
    reserve = direct[1]
    assert reserve.attributes == {"db.system": "postgresql", "db.operation": "reserve"}
    assert direct[0].attributes == {"db.system": "redis", "db.operation": "get"}
    first, second = direct[2], direct[3]
    assert first.kind is second.kind is SpanKind.CLIENT
    assert first.attributes is not None
    assert second.attributes is not None
    assert (first.attributes["gateway.attempt"], second.attributes["gateway.attempt"]) == (1, 2)
    assert first.attributes["http.response.status_code"] == 503
    assert second.attributes["http.response.status_code"] == 201
    # The decisions: the breaker counts the 503 as a failure, the loop retries; then the
    # breaker counts a success and the loop stops.
    assert [name for name, _ in events(first)] == ["breaker.verdict", "retry"]
    assert events(first)[0][1] == {"gateway.failure": True}
    assert events(first)[1][1]["gateway.cause"] == "status 503"
    assert events(second) == [
        ("breaker.verdict", {"gateway.failure": False}),
        ("retry.declined", {"gateway.reason": "success"}),
    ]
    # After the pause the lease is confirmed afresh before the second attempt: a renewal
    # inside the first attempt's span, which lasts until the next attempt starts.
    assert names(children(spans, first)) == ["store renew_lease"], tree(spans)
    # Every span is in the one trace, and each attempt told the upstream its own span.
    assert {trace_id(span) for span in spans} == {trace_id(server)}
    assert [sent_trace(execution.headers["traceparent"]) for execution in upstream.executions] == [
        (trace_id(server), span_id(first)),
        (trace_id(server), span_id(second)),
    ]


async def test_a_callers_traceparent_is_continued_and_replaced_upstream(
    traced: tuple[RunningGateway, InMemorySpanExporter], upstream: RecordingUpstream
) -> None:
    gateway, exporter = traced
    headers = keyed_headers(
        f"trace-{uuid.uuid4()}",
        headers={"Authorization": AUTHORIZATION, "traceparent": CALLER_TRACEPARENT},
    )
    response = await gateway.client.post(CHARGES, json=CHARGE, headers=headers)
    assert response.status_code == 201, response.text

    (spans,) = await traces(exporter, 1)
    server = spans[0]
    assert (trace_id(server), parent_id(server)) == (CALLER_TRACE_ID, CALLER_SPAN_ID)
    (attempt,) = [span for span in spans if span.name == "upstream primary"]
    (execution,) = upstream.executions
    assert sent_trace(execution.headers["traceparent"]) == (CALLER_TRACE_ID, span_id(attempt))
    # Replaced, not added to: the upstream sees one traceparent, the gateway's.
    assert [name for name, _ in execution.raw_headers if name.lower() == "traceparent"] == [
        "traceparent"
    ]


async def test_a_replay_is_answered_from_the_cache_with_no_upstream_span(
    traced_redis_only: tuple[RunningGateway, InMemorySpanExporter], upstream: RecordingUpstream
) -> None:
    gateway, exporter = traced_redis_only
    key = f"trace-{uuid.uuid4()}"
    first = await send_keyed(gateway.client, key)
    replayed = await send_keyed(gateway.client, key)
    assert first.status_code == replayed.status_code == 201
    assert is_replay(replayed)
    assert len(upstream.executions) == 1

    _, spans = await traces(exporter, 2)
    assert names(spans) == ["POST root", "cache get"], tree(spans)
    assert spans[0].attributes is not None
    assert spans[0].attributes["gateway.outcome"] == "replayed"
    assert spans[0].attributes["gateway.attempts"] == 0


async def test_a_replay_from_the_process_memory_is_the_server_span_alone(
    traced: tuple[RunningGateway, InMemorySpanExporter], upstream: RecordingUpstream
) -> None:
    """The in-process copy is a dictionary lookup: no cache span, and Redis is not asked."""
    gateway, exporter = traced
    key = f"trace-{uuid.uuid4()}"
    first = await send_keyed(gateway.client, key)
    replayed = await send_keyed(gateway.client, key)
    assert first.status_code == replayed.status_code == 201
    assert is_replay(replayed)
    assert len(upstream.executions) == 1

    _, spans = await traces(exporter, 2)
    assert names(spans) == ["POST root"], tree(spans)
    assert spans[0].attributes is not None
    assert spans[0].attributes["gateway.outcome"] == "replayed"


async def test_a_request_sampled_out_opens_no_span_and_sends_no_traceparent(
    upstream: RecordingUpstream, postgres_url: str, redis_url: str
) -> None:
    exporter = InMemorySpanExporter()
    config = keyed_gateway_config(
        upstream.url, tracing={"enabled": True, "service_name": SERVICE, "sample_ratio": 0.0}
    )
    async with running_gateway(
        config,
        database_url=postgres_url,
        redis_url=redis_url,
        span_processor=SimpleSpanProcessor(exporter),
    ) as gateway:
        response = await send_keyed(gateway.client, f"trace-{uuid.uuid4()}")
        assert response.status_code == 201, response.text
    # Shut down: every span that ended was exported; the store, cache and attempt hooks
    # opened none under the request's non-recording span.
    assert exporter.get_finished_spans() == ()
    (execution,) = upstream.executions
    assert "traceparent" not in execution.headers


# Serves one keyed request with tracing off, noting every package that asks for an
# ``opentelemetry`` module: redis-py (8 and later) loads OpenTelemetry's metrics API and SDK
# itself whenever they are installed, and FastAPI looks for it, so the check is who imports,
# not what is loaded.
_TRACING_OFF = textwrap.dedent(
    """
    import asyncio, json, sys, uuid

    importers = set()

    class NoteImporters:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == "opentelemetry":
                frame = sys._getframe(1)
                while frame is not None:
                    module = frame.f_globals.get("__name__", "")
                    if not module.startswith(("importlib", "opentelemetry")):
                        importers.add(module.split(".")[0])
                        break
                    frame = frame.f_back
            return None

    sys.meta_path.insert(0, NoteImporters())

    from tests.support import RecordingUpstream
    from tests.support.gateway import running_gateway
    from tests.support.keyed import keyed_gateway_config, send_keyed

    async def main() -> None:
        async with RecordingUpstream() as upstream:
            config = keyed_gateway_config(upstream.url)
            async with running_gateway(config, database_url=sys.argv[1]) as gateway:
                response = await send_keyed(gateway.client, f"off-{uuid.uuid4()}")
        tracing_modules = [
            name for name in ("idempotency_gateway.telemetry.otel", "opentelemetry.sdk.trace")
            if name in sys.modules
        ]
        print(json.dumps({
            "status": response.status_code,
            "importers": sorted(importers),
            "tracing_modules": tracing_modules,
        }))

    asyncio.run(main())
    """
)


def test_with_tracing_off_the_gateway_imports_no_opentelemetry_module(postgres_url: str) -> None:
    """A keyed request served end to end in a fresh interpreter with the extra installed:
    the hooks ran, nothing of the gateway asked for OpenTelemetry, and no tracer was built."""
    result = subprocess.run(
        [sys.executable, "-c", _TRACING_OFF, postgres_url],
        cwd=Path(__file__).resolve().parent.parent,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    outcome = json.loads(result.stdout.splitlines()[-1])
    assert outcome["status"] == 201
    assert outcome["tracing_modules"] == []
    # Libraries may look for it (redis-py and FastAPI do); the gateway never does.
    assert "idempotency_gateway" not in outcome["importers"], outcome
    assert "tests" not in outcome["importers"], outcome
