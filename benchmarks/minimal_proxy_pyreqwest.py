"""The minimal proxy with pyreqwest (Rust reqwest + hyper) as its upstream client.

    BENCH_UPSTREAM_URL=http://127.0.0.1:9000 uvicorn benchmarks.minimal_proxy_pyreqwest:app \
        --loop uvloop --http httptools --workers 1

Everything else is `minimal_proxy.py`'s (benchmarks/proxy_rules.py), so the two differ only
in the client. The client keeps the rules a real gateway needs: it never decompresses, keeps
no cookies, follows no redirect, sets no Referer, ignores proxy variables, speaks HTTP/1.1
only, streams the response body, and bounds each try (connect, read, whole exchange).
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

from pyreqwest.client import Client, ClientBuilder

from benchmarks.proxy_rules import HOP, forwarded_headers, read_body, upstream_target

UPSTREAM = os.environ.get("BENCH_UPSTREAM_URL", "http://127.0.0.1:9000")
CONNECT_TIMEOUT = timedelta(seconds=5)
READ_TIMEOUT = timedelta(seconds=30)  # between two reads of the answer
TRY_TIMEOUT = timedelta(seconds=60)  # one try, from connecting to the last body byte
CHUNK = 64 * 1024
client: Client | None = None


def build_client() -> Client:
    return (
        ClientBuilder()
        .gzip(False).brotli(False).zstd(False).deflate(False)
        .default_cookie_store(False)
        .follow_redirects(False)
        .referer(False)
        .no_proxy()
        .http1_only()
        .error_for_status(False)
        .connect_timeout(CONNECT_TIMEOUT)
        .read_timeout(READ_TIMEOUT)
        .timeout(TRY_TIMEOUT)
        .build()
    )  # fmt: skip


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    global client
    if scope["type"] == "lifespan":
        await receive()  # startup
        client = build_client()
        await send({"type": "lifespan.startup.complete"})
        await receive()  # shutdown
        await client.close()
        await send({"type": "lifespan.shutdown.complete"})
        return
    assert client is not None
    body = await read_body(receive)
    request = client.request(scope["method"], UPSTREAM + upstream_target(scope))
    request = request.headers(forwarded_headers(scope))
    if body:
        request = request.body_bytes(body)
    async with request.build_streamed() as response:
        out = [(k.encode(), v.encode("latin-1")) for k, v in response.headers.items()]
        out = [(k, v) for k, v in out if k not in HOP]
        await send({"type": "http.response.start", "status": response.status, "headers": out})
        while (chunk := await response.body_reader.read(CHUNK)) is not None:
            await send({"type": "http.response.body", "body": bytes(chunk), "more_body": True})
    await send({"type": "http.response.body", "body": b""})
