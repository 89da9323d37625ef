"""Answered requests are freed as they end, not left to the cycle collector: a reference
cycle per request (the response cycle naming itself through its transport's close callback)
left a dozen objects each for the collector to find, a tenth of the edge's work per request."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Iterator

import pytest
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from idempotency_gateway.asgi import Receive, Scope, Send
from idempotency_gateway.server.protocol import EdgeProtocol
from tests.support import serve_asgi

REQUESTS = 20
ANSWER = b"ok"


async def constant(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] != "http":
        return
    await receive()
    headers = [(b"content-length", b"%d" % len(ANSWER))]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": ANSWER})


@pytest.fixture
def garbage_kept() -> Iterator[list[object]]:
    """What the collector finds unreachable, kept in ``gc.garbage`` instead of freed."""
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        yield gc.garbage
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


async def test_answered_requests_leave_no_response_cycle_to_the_collector(
    garbage_kept: list[object],
) -> None:
    async with serve_asgi(constant, http=EdgeProtocol, lifespan="off") as url:
        reader, writer = await asyncio.open_connection(*url.removeprefix("http://").split(":"))
        for _ in range(REQUESTS):  # one keep-alive connection: a cycle per request
            writer.write(b"POST /charges HTTP/1.1\r\nHost: gateway\r\nContent-Length: 2\r\n\r\n{}")
            head = await reader.readuntil(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200 ")
            assert await reader.readexactly(len(ANSWER)) == ANSWER
        writer.close()
        await writer.wait_closed()
        gc.collect()

    left = [thing for thing in garbage_kept if isinstance(thing, RequestResponseCycle)]
    assert left == []
