"""The ceiling for a Python proxy: pure ASGI, one aiohttp session, no idempotency, no checks.

    BENCH_UPSTREAM_URL=http://127.0.0.1:9000 uvicorn benchmarks.minimal_proxy:app \
        --loop uvloop --http httptools --workers 1
"""

from __future__ import annotations

import os
from typing import Any

import aiohttp
from yarl import URL

from benchmarks.proxy_rules import HOP, forwarded_headers, read_body, upstream_target

UPSTREAM = os.environ.get("BENCH_UPSTREAM_URL", "http://127.0.0.1:9000")
session: aiohttp.ClientSession | None = None


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    global session
    if scope["type"] == "lifespan":
        await receive()  # startup
        session = aiohttp.ClientSession(auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar())
        await send({"type": "lifespan.startup.complete"})
        await receive()  # shutdown
        await session.close()
        await send({"type": "lifespan.shutdown.complete"})
        return
    assert session is not None
    body = await read_body(receive)
    async with session.request(
        scope["method"], URL(UPSTREAM + upstream_target(scope), encoded=True),
        headers=forwarded_headers(scope), data=body or None, allow_redirects=False,
    ) as response:  # fmt: skip
        out = [(k.lower(), v) for k, v in response.raw_headers if k.lower() not in HOP]
        await send({"type": "http.response.start", "status": response.status, "headers": out})
        async for chunk in response.content.iter_chunked(64 * 1024):
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
    await send({"type": "http.response.body", "body": b""})
