"""ASGI type aliases and the few header helpers every layer needs."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
Headers = list[tuple[bytes, bytes]]


def header_values(headers: Headers, name: bytes) -> list[bytes]:
    """All values of one field; ``name`` must be lower-case, as ASGI servers deliver them."""
    return [value for key, value in headers if key == name]


def first_header(headers: Headers, name: bytes) -> bytes | None:
    for key, value in headers:
        if key == name:
            return value
    return None


def replay_receive(body: bytes) -> Receive:
    """A ``receive`` that hands an already-read body to the next app, then waits for nothing."""
    sent = False

    async def receive() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        # After the body the only thing an app can wait for is a disconnect; the owner's
        # execution must never be cut short by one, so it never comes.
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    return receive


class ClientDisconnected(Exception):
    """The client went away before its request body arrived."""


async def read_body(receive: Receive, headers: Headers, *, limit: int) -> bytes:
    """The whole request body, refusing more than ``limit`` bytes before reading them all."""
    from idempotency_gateway.errors import RequestBodyTooLarge

    too_large = RequestBodyTooLarge(f"the request body is larger than {limit} bytes")
    declared = first_header(headers, b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnected
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)
