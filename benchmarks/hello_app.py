"""A constant answer, no upstream: what the ASGI server alone costs per request.

    uvicorn benchmarks.hello_app:app --loop uvloop --http httptools --workers 1
    granian --interface asgi --loop uvloop --workers 1 benchmarks.hello_app:app

It reads the request body as the proxies do, then answers the upstream's small document, so
the hello scenarios and the minimal proxies differ by the upstream client and its round trip.
"""

from __future__ import annotations

from typing import Any

from benchmarks.proxy_rules import read_body
from benchmarks.upstream import SMALL_BODY

HEADERS = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(SMALL_BODY))]


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    await read_body(receive)
    await send({"type": "http.response.start", "status": 200, "headers": HEADERS})
    await send({"type": "http.response.body", "body": SMALL_BODY})
