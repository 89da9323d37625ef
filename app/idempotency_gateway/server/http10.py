"""HTTP/1.0 framing: no chunked coding for clients that cannot read it.

uvicorn frames every answer without Content-Length as chunked, whatever the request's
version. RFC 9112 section 6.1 forbids Transfer-Encoding toward an HTTP/1.0 client; such an
answer is instead delimited by closing the connection (uvicorn closes HTTP/1.0 connections
after one answer anyway).

A close that delimits an answer says "this is all of it", so an answer that breaks off
(the upstream died mid-body, the app failed) must not end with one: the connection is
reset instead (RFC 9112 section 8), which the client reads as an incomplete answer.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import sys

from uvicorn._types import (
    ASGI3Application,
    ASGIReceiveCallable,
    ASGISendCallable,
    ASGISendEvent,
    Scope,
)
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

_BODILESS_STATUSES = (204, 304)


def _has_content_length(message: ASGISendEvent) -> bool:
    headers = message.get("headers", [])
    return any(name.lower() == b"content-length" for name, _ in headers)  # type: ignore[attr-defined]


# SO_LINGER on, with no time to linger: closing sends a reset rather than an orderly FIN.
_RESET_ON_CLOSE = struct.pack("ii", 1, 0)


def reset(transport: asyncio.Transport) -> None:
    """Drop the connection with a TCP reset, so the peer cannot take it for an end."""
    if transport.is_closing():
        return  # already going (the client left): nothing to tell it any more
    sock = transport.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET_ON_CLOSE)
    transport.abort()


def close_delimited(app: ASGI3Application, cycle: RequestResponseCycle) -> ASGI3Application:
    """``app`` with its answers to ``cycle`` delimited by close instead of chunks."""

    async def app_without_chunks(
        scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable
    ) -> None:
        unframed = False
        ended = False

        async def framed_send(message: ASGISendEvent) -> None:
            nonlocal unframed, ended
            if (
                message["type"] == "http.response.start"
                and not _has_content_length(message)
                and message["status"] not in _BODILESS_STATUSES
                and cycle.scope["method"] != "HEAD"
            ):
                # Marked as not chunked before uvicorn writes the head, with no length limit.
                unframed = True
                cycle.chunked_encoding = False
                cycle.expected_content_length = sys.maxsize
            elif (
                unframed
                and message["type"] == "http.response.body"
                and not message.get("more_body", False)
            ):
                # uvicorn checks that the last chunk ends the declared length exactly.
                cycle.expected_content_length = len(message.get("body", b""))
                ended = True
            await send(message)

        try:
            await app(scope, receive, framed_send)
        finally:
            if unframed and not ended:
                reset(cycle.transport)

    return app_without_chunks
