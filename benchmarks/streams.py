"""Streams followed live: gateway CPU per event and resident memory, 100 streams at once.

    .venv/bin/python -m benchmarks.streams [--streams 100] [--tokens 200] [--pace 0.02]

An SSE upstream in this process answers every POST with ``--tokens`` events, one every
``--pace`` seconds (an LLM's pace). Each of ``--streams`` clients posts with a key of its own;
once its first event is in, a follower posts the same request with the same key and follows
the stream to its end. Every client reads every event over loopback. Three set-ups:

- no follower: the streams alone (what following adds is measured against this);
- in process: one gateway, the follower on the owner's process (no Redis);
- Redis: two gateways sharing PostgreSQL and Redis, the follower on the other one.

Per set-up: the gateways' CPU (user + system, every process, from /proc) per event delivered
(to owners and followers), and the largest resident memory of a gateway process, sampled
every 100 ms, next to its memory before the streams started.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from benchmarks.processes import (
    ManagedProcess,
    clean_environment,
    cpu_seconds,
    free_port,
    rss_kib,
    spawn,
    venv_tool,
    wait_until_answers,
)
from benchmarks.services import (
    DEFAULT_REDIS_URL,
    DEFAULT_SERVER_URL,
    prepare_database,
)

PATH = b"/v1/chat"


@dataclass(frozen=True)
class Setup:
    label: str
    gateways: int
    redis: bool
    follow: bool


SETUPS = (
    Setup("no follower", 1, redis=False, follow=False),
    Setup("in process (1 gateway)", 1, redis=False, follow=True),
    Setup("Redis (2 gateways, follower on the other)", 2, redis=True, follow=True),
)


@dataclass(frozen=True)
class Row:
    setup: str
    events: int
    seconds: float
    cpu_us_per_event: float
    rss_before_mib: float
    rss_peak_mib: float
    conflicts: int  # 409s followers got before they could follow


async def _tokens(request: web.Request) -> web.StreamResponse:
    tokens, pace = request.app["tokens"], request.app["pace"]
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for index in range(tokens):
        await response.write(b"id: %d\ndata: token-%d\n\n" % (index, index))
        await asyncio.sleep(pace)
    await response.write_eof()
    return response


def _config(work: Path, upstream_port: int) -> Path:
    path = work / "streams.yaml"
    path.write_text(
        f"""upstreams:
  llm:
    url: http://127.0.0.1:{upstream_port}
    timeouts: {{per_try: 120s, total: 120s}}
    pool: {{max_connections: 200}}
routes:
  - name: chat
    match: {{path_prefix: /}}
    upstream: llm
    idempotency: {{key: required, streaming: {{follow: true}}}}
"""
    )
    return path


def _start_gateway(
    work: Path, config: Path, name: str, variables: dict[str, str]
) -> tuple[ManagedProcess, int]:
    port, admin_port = free_port(), free_port()
    argv = [
        venv_tool("idempotency-gateway"), "serve", "--config", str(config),
        "--port", str(port), "--admin-port", str(admin_port), "--log-level", "warning",
    ]  # fmt: skip
    process = spawn(
        name, argv, log_dir=work, env=clean_environment(variables), cwd=work, ports=(port,)
    )
    wait_until_answers(process, admin_port, "/readyz")
    return process, port


class InFlight(Exception):
    """A 409: the follower came before the stream could be followed there."""


async def _stream(port: int, key: bytes, first_event: asyncio.Event | None) -> int:
    """One keyed POST read to its end; the number of events it delivered."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        b"POST " + PATH + b" HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n"
        b"Authorization: Bearer bench\r\nIdempotency-Key: " + key + b"\r\n"
        b"Content-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
    )  # fmt: skip
    events = 0
    try:
        head = await reader.readuntil(b"\r\n\r\n")
        if head.startswith(b"HTTP/1.1 409"):
            raise InFlight
        if not head.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(f"the gateway answered {head[:200]!r}")
        while chunk := await reader.read(65536):
            events += chunk.count(b"\n\n")
            if first_event is not None and events:
                first_event.set()
    finally:
        writer.close()
    return events


async def _follower(port: int, key: bytes, conflicts: list[int]) -> int:
    """A follower retries a 409 as a client would (sooner: the first events go by fast)."""
    while True:
        try:
            return await _stream(port, key, None)
        except InFlight:
            conflicts[0] += 1
            await asyncio.sleep(0.05)


async def _pair(ports: list[int], follow: bool, conflicts: list[int]) -> int:
    key, started = uuid.uuid4().hex.encode(), asyncio.Event()
    owner = asyncio.create_task(_stream(ports[0], key, started))
    if not follow:
        return await owner
    await started.wait()
    return sum(await asyncio.gather(owner, _follower(ports[-1], key, conflicts)))


async def _sample_rss(pids: list[int], peak: list[int], stop: asyncio.Event) -> None:
    while not stop.is_set():
        peak[0] = max(peak[0], max((rss_kib(pid) or 0) for pid in pids))
        await asyncio.sleep(0.1)


async def _run_streams(ports: list[int], pids: list[int], streams: int, follow: bool) -> Row:
    rss_before = max((rss_kib(pid) or 0) for pid in pids)
    peak, stop = [rss_before], asyncio.Event()
    sampler = asyncio.create_task(_sample_rss(pids, peak, stop))
    cpu_before, started, conflicts = cpu_seconds(pids), time.perf_counter(), [0]
    delivered = sum(
        await asyncio.gather(*(_pair(ports, follow, conflicts) for _ in range(streams)))
    )
    seconds, cpu = time.perf_counter() - started, cpu_seconds(pids) - cpu_before
    stop.set()
    await sampler
    return Row(
        "",
        delivered,
        seconds,
        cpu / delivered * 1e6,
        rss_before / 1024,
        peak[0] / 1024,
        conflicts[0],
    )


async def _measure(args: argparse.Namespace, setup: Setup, work: Path, database_url: str) -> Row:
    app = web.Application()
    app["tokens"], app["pace"] = args.tokens, args.pace
    app.router.add_post("/{tail:.*}", _tokens)
    runner = web.AppRunner(app, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    variables = {"GATEWAY_DATABASE_URL": database_url, "GATEWAY_SCOPE_SECRET": "bench-streams"}
    if setup.redis:
        variables["GATEWAY_REDIS_URL"] = args.redis_url
    config = _config(work, runner.addresses[0][1])
    gateways = [
        await asyncio.to_thread(_start_gateway, work, config, f"gw-{index}", variables)
        for index in range(setup.gateways)
    ]
    try:
        pids = [pid for process, _ in gateways for pid in process.tree()]
        row = await _run_streams([port for _, port in gateways], pids, args.streams, setup.follow)
        return dataclasses.replace(row, setup=setup.label)
    finally:
        for process, _ in gateways:
            process.stop()
        await runner.cleanup()


def table(rows: list[Row], args: argparse.Namespace) -> str:
    lines = [
        f"{args.streams} streams of {args.tokens} events, one every {args.pace * 1000:g} ms; "
        "events delivered to owners and followers.",
        "",
        "| set-up | events delivered | seconds | gateway CPU per event (µs) | RSS before (MiB) "
        "| RSS peak (MiB) | followers' 409s |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {row.setup} | {row.events:,} | {row.seconds:.1f} | {row.cpu_us_per_event:.0f} | "
        f"{row.rss_before_mib:.0f} | {row.rss_peak_mib:.0f} | {row.conflicts} |"
        for row in rows
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.streams")
    parser.add_argument("--streams", type=int, default=100)
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--pace", type=float, default=0.02, help="seconds between events")
    parser.add_argument("--postgres-url", default=DEFAULT_SERVER_URL)
    parser.add_argument("--database", default="idempotency_gateway_bench_streams")
    # Not flushed: each stream's key is new, and its Redis stream expires on its own.
    parser.add_argument("--redis-url", default=DEFAULT_REDIS_URL)
    args = parser.parse_args()
    database_url = prepare_database(args.postgres_url, args.database, recreate=True)
    with tempfile.TemporaryDirectory(prefix="streams-bench-") as work:
        rows = [asyncio.run(_measure(args, setup, Path(work), database_url)) for setup in SETUPS]
    print(table(rows, args))


if __name__ == "__main__":
    main()
