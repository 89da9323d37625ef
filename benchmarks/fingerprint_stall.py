"""The worst event-loop stall a keyed request at the size limits causes, and its fingerprint's CPU.

    .venv/bin/python -m benchmarks.fingerprint_stall [--requests 5] [--database NAME]

A real gateway process (``serve``, one worker, PostgreSQL) gets keyed POSTs with bodies at
the limits, one at a time, while a probe client sends an unkeyed ``GET /small`` through the
same worker every 10 ms on a connection of its own. For each body:

- the probe's slowest answer while the bodies were being sent: the longest another client
  waited on that worker (its normal answer takes about a millisecond);
- the largest event-loop lag the worker itself reported (``event_loop_lag_seconds``, the
  upper bound of the highest bucket that grew);
- the worker's CPU per request (whole request: reading the body, the fingerprint, the
  record, forwarding the body upstream; the probe's own requests too), from /proc;
- the fingerprint alone (``request_hash``, CPU time in this process, median of the runs).

Bodies: JSON of decimal numbers at the gateway's body limit (10 MiB), JSON at the route's
canonical limit (64 KiB by default, and 1 MiB, the most a route may set), and 10 MiB that is
not JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from benchmarks.bodies import MAX_BODY, numbers
from benchmarks.processes import cpu_seconds
from benchmarks.servers import (
    RunContext,
    RunningServer,
    ServerSpec,
    start_server,
    start_upstream,
)
from benchmarks.services import DEFAULT_SERVER_URL, prepare_database
from idempotency_gateway.config import DEFAULT_MAX_CANONICAL_BODY, MAX_CANONICAL_BODY
from idempotency_gateway.idempotency.fingerprint import request_hash

PROBE_EVERY = 0.01
_LAG_BUCKET = re.compile(
    rb'^idempotency_gateway_event_loop_lag_seconds_bucket\{le="([^"]+)"\} (\S+)$'
)


@dataclass(frozen=True)
class Body:
    label: str
    content_type: bytes
    data: bytes


def bodies(canonical_limit: int) -> list[Body]:
    json, octets = b"application/json", b"application/octet-stream"
    return [
        Body(
            f"JSON numbers, {canonical_limit // 1024} KiB (canonical)",
            json,
            numbers(canonical_limit),
        ),
        Body("JSON numbers, 10 MiB (byte-exact)", json, numbers(MAX_BODY)),
        Body("not JSON, 10 MiB", octets, bytes(MAX_BODY)),
    ]


async def _response(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
    if length is None:
        raise RuntimeError(f"an answer without Content-Length: {head!r}")
    return head + await reader.readexactly(int(length.group(1)))


async def _exchange(port: int, request: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        await writer.drain()
        return await _response(reader)
    finally:
        writer.close()


def _keyed_post(body: Body) -> bytes:
    head = (
        b"POST /upload HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n"
        b"Idempotency-Key: " + uuid.uuid4().hex.encode() + b"\r\n"
        b"Content-Type: " + body.content_type + b"\r\n"
        b"Content-Length: " + str(len(body.data)).encode() + b"\r\n\r\n"
    )  # fmt: skip
    return head + body.data


async def _probe(
    port: int, ready: asyncio.Event, stop: asyncio.Event, latencies: list[float]
) -> None:
    """Another client on the same worker: one small request every ``PROBE_EVERY`` seconds."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    request = b"GET /small HTTP/1.1\r\nHost: bench\r\n\r\n"
    try:
        while not stop.is_set():
            started = time.perf_counter()
            writer.write(request)
            await _response(reader)
            if ready.is_set():
                latencies.append(time.perf_counter() - started)
            ready.set()
            await asyncio.sleep(PROBE_EVERY)
    finally:
        writer.close()


def lag_buckets(metrics: bytes) -> dict[float, float]:
    found = {}
    for line in metrics.splitlines():
        match = _LAG_BUCKET.match(line)
        if match:
            found[float(match.group(1))] = float(match.group(2))
    return found


async def _lag(admin_port: int) -> dict[float, float]:
    answer = await _exchange(admin_port, b"GET /metrics HTTP/1.1\r\nHost: bench\r\n\r\n")
    return lag_buckets(answer)


def worst_lag(before: dict[float, float], after: dict[float, float]) -> str:
    """The upper bound of the lowest bucket that holds every sample taken in between."""
    grown = after.get(float("inf"), 0) - before.get(float("inf"), 0)
    for bound in sorted(after):
        if after[bound] - before.get(bound, 0) >= grown:
            return f"<= {bound * 1000:g} ms" if bound != float("inf") else "> 10 s"
    return "no samples"


def fingerprint_cpu(body: Body, canonical_limit: int, runs: int) -> float:
    def once() -> float:
        started = time.process_time()
        request_hash(
            method="POST",
            path=b"/upload",
            query_string=b"",
            headers=[(b"content-type", body.content_type)],
            body=body.data,
            max_canonical_body=canonical_limit,
        )
        return time.process_time() - started

    return statistics.median(once() for _ in range(runs))


@dataclass(frozen=True)
class Row:
    limit: int
    body: str
    probe_worst_ms: float
    probe_median_ms: float
    loop_lag: str
    worker_cpu_ms: float
    fingerprint_cpu_ms: float


async def _measure_body(
    server: RunningServer, admin_port: int, body: Body, requests: int
) -> tuple[float, float, str, float]:
    port, processes = server.port, server.process.tree()  # the supervisor and its worker
    ready, stop, latencies = asyncio.Event(), asyncio.Event(), list[float]()
    probe = asyncio.create_task(_probe(port, ready, stop, latencies))
    await ready.wait()  # its connection is up and answered once
    lag_before, cpu_before = await _lag(admin_port), cpu_seconds(processes)
    for _ in range(requests):
        answer = await _exchange(port, _keyed_post(body))
        if not answer.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(f"the gateway answered {answer[:200]!r}")
    cpu = (cpu_seconds(processes) - cpu_before) / requests
    lag_after = await _lag(admin_port)
    stop.set()
    await probe
    return max(latencies), statistics.median(latencies), worst_lag(lag_before, lag_after), cpu


def run(server_url: str, database: str, requests: int) -> list[Row]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="fingerprint-stall-") as work:
        work_dir = Path(work)
        ctx = RunContext(
            work_dir=work_dir,
            log_dir=work_dir,
            database_url=prepare_database(server_url, database, recreate=True),
            redis_url=None,
            nginx=None,
        )
        upstream = start_upstream(ctx, use_nginx=False)
        try:
            for limit in (DEFAULT_MAX_CANONICAL_BODY, MAX_CANONICAL_BODY):
                spec = ServerSpec(
                    f"gw-canonical-{limit}", "gateway", "gateway", max_canonical_body=limit
                )
                server = start_server(spec, ctx)
                try:
                    for body in bodies(limit):
                        assert server.admin_port is not None
                        worst, median, lag, cpu = asyncio.run(
                            _measure_body(server, server.admin_port, body, requests)
                        )
                        rows.append(
                            Row(
                                limit,
                                body.label,
                                worst * 1000,
                                median * 1000,
                                lag,
                                cpu * 1000,
                                fingerprint_cpu(body, limit, requests) * 1000,
                            )
                        )
                finally:
                    server.stop()
        finally:
            upstream.stop()
    return rows


def table(rows: list[Row]) -> str:
    lines = [
        "| route limit | body | another client's slowest answer (ms) | its median (ms) | worst "
        "loop lag (metric) | worker CPU per request (ms) | fingerprint CPU (ms) |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row.limit // 1024} KiB | {row.body} | {row.probe_worst_ms:.1f} | "
            f"{row.probe_median_ms:.1f} | "
            f"{row.loop_lag} | {row.worker_cpu_ms:.0f} | {row.fingerprint_cpu_ms:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fingerprint_stall")
    parser.add_argument("--postgres-url", default=DEFAULT_SERVER_URL)
    parser.add_argument(
        "--database",
        default="idempotency_gateway_bench_fingerprint",
        help="dropped and created afresh",
    )
    parser.add_argument("--requests", type=int, default=5, help="requests per body")
    args = parser.parse_args()
    print(table(run(args.postgres_url, args.database, args.requests)))


if __name__ == "__main__":
    main()
