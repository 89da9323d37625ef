"""Client CPU per upstream request: aiohttp's client against the gateway's own.

    .venv/bin/python -m benchmarks.upstream_clients [--url http://127.0.0.1:18080] [--requests N]

Each client sends what the gateway's pass-through sends (a GET with the fields the proxy
adds) from ``--concurrency`` tasks at once over keep-alive connections, and reads the whole
answer: ``/small`` (a tiny JSON document) and ``/large`` (1 MiB, streamed). aiohttp is set up
as the gateway used it (no cookie jar, no decompression, no automatic fields, no silent
resend); the gateway's client is ``UpstreamClient`` as ``ResilientUpstream`` calls it.

What is measured is the CPU time of this process (``time.process_time``) per request, not
wall time: the machine is shared. Without ``--url`` the bundled upstream
(``benchmarks/upstream.py``) runs in a process of its own, so its CPU is not counted; with
``--url``, the paths the server there does not answer with 200 are skipped.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

import aiohttp
from yarl import URL

from benchmarks.processes import (
    clean_environment,
    free_port,
    http_status,
    spawn,
    wait_until_answers,
)
from benchmarks.runloop import run_fast
from idempotency_gateway.config import UpstreamConfig
from idempotency_gateway.proxy.upstream_client import UpstreamClient, UpstreamRequest

# What the proxy adds to a plain client request (proxy/headers.py), plus a client's own two.
FIELDS = [
    (b"user-agent", b"bench/1.0"),
    (b"accept", b"*/*"),
    (b"x-request-id", b"0123456789abcdef0123456789abcdef"),
    (b"via", b"1.1 idempotency-gateway"),
    (b"x-forwarded-for", b"127.0.0.1"),
    (b"x-forwarded-proto", b"http"),
    (b"x-forwarded-host", b"127.0.0.1:8080"),
    (b"x-request-timeout", b"10.000"),
]

REPO = Path(__file__).resolve().parent.parent

Fetch = Callable[[bytes], Awaitable[int]]
"""GET a path, read the whole body; the number of body bytes read."""


async def aiohttp_client(base: str, concurrency: int, stack: AsyncExitStack) -> Fetch:
    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=concurrency, limit_per_host=0),
        cookie_jar=aiohttp.DummyCookieJar(),
        auto_decompress=False,
        # The gateway's default timeouts: connect 1 s, per_try 10 s as the socket read bound.
        timeout=aiohttp.ClientTimeout(total=None, connect=1.0, sock_read=10.0),
        skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
    )
    session._retry_connection = False
    stack.push_async_callback(session.close)
    fields = [(name.decode(), value.decode()) for name, value in FIELDS]

    async def fetch(path: bytes) -> int:
        url = URL(base + path.decode(), encoded=True)
        size = 0
        async with asyncio.timeout(10.0):  # head_within, as the gateway bounded each attempt
            answer = await session.request("GET", url, headers=fields, allow_redirects=False)
        try:
            async for chunk in answer.content.iter_chunked(64 * 1024):
                size += len(chunk)
        finally:
            answer.release()
        return size

    return fetch


async def gateway_client(base: str, concurrency: int, stack: AsyncExitStack) -> Fetch:
    client = UpstreamClient(
        "bench", UpstreamConfig(url=base, pool={"max_connections": concurrency})
    )
    await client.start()
    stack.push_async_callback(client.close)

    async def fetch(path: bytes) -> int:
        request = UpstreamRequest(method="GET", target=path, headers=FIELDS, body=b"")
        answer = await client.open(request, head_within=10.0)
        size = 0
        try:
            async for chunk, _ in answer.chunks():
                size += len(chunk)
        finally:
            answer.release()
        return size

    return fetch


CLIENTS: dict[str, Callable[[str, int, AsyncExitStack], Awaitable[Fetch]]] = {
    "aiohttp (the gateway's client before)": aiohttp_client,
    "the gateway's client (httptools, proxy/upstream_client.py)": gateway_client,
}
PATHS = {"/small": 11, "/large (1 MiB)": 1024 * 1024}


async def cpu_per_request(fetch: Fetch, path: bytes, size: int, requests: int, tasks: int) -> float:
    """Microseconds of this process's CPU per request from ``tasks`` concurrent tasks,
    after a warm-up that opens every connection."""

    async def worker(count: int) -> None:
        for _ in range(count):
            got = await fetch(path)
            assert got == size, f"{path!r}: {got} bytes, expected {size}"

    await asyncio.gather(*(worker(2) for _ in range(tasks)))
    per_task = max(1, requests // tasks)
    started = time.process_time()
    await asyncio.gather(*(worker(per_task) for _ in range(tasks)))
    return (time.process_time() - started) / (per_task * tasks) * 1e6


@asynccontextmanager
async def bundled_upstream() -> AsyncIterator[str]:
    port = free_port()
    with tempfile.TemporaryDirectory() as logs:
        process = spawn(
            "upstream",
            [sys.executable, "-m", "benchmarks.upstream", "--port", str(port)],
            log_dir=Path(logs),
            env=clean_environment(),
            cwd=REPO,
            ports=(port,),
        )
        try:
            wait_until_answers(process, port, "/small")
            yield f"http://127.0.0.1:{port}"
        finally:
            process.stop()


async def measure(base: str, args: argparse.Namespace) -> None:
    port = URL(base).port or 80
    paths = {
        label: size for label, size in PATHS.items() if http_status(port, label.split()[0]) == 200
    }
    print(f"| client | path | client CPU per request (us, best of {args.rounds}) |")
    print("|---|---|---|")
    for name, build in CLIENTS.items():
        async with AsyncExitStack() as stack:
            fetch = await build(base, args.concurrency, stack)
            for label, size in paths.items():
                path = label.split()[0].encode()
                count = args.requests if size < 1024 else max(args.concurrency, args.requests // 20)
                rounds = [
                    await cpu_per_request(fetch, path, size, count, args.concurrency)
                    for _ in range(args.rounds)
                ]
                print(f"| {name} | {label} | {min(rounds):.1f} |", flush=True)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="an upstream serving /small and /large (default: bundled)")
    parser.add_argument("--requests", type=int, default=10_000, help="per round, for /small")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3, help="best of N rounds is reported")
    args = parser.parse_args()
    if args.url:
        await measure(args.url.rstrip("/"), args)
        return
    async with bundled_upstream() as base:
        await measure(base, args)


if __name__ == "__main__":
    run_fast(main())
