"""ASGI type aliases and the few header helpers every layer needs."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine, MutableMapping
from typing import Any, TypeVar

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
Headers = list[tuple[bytes, bytes]]
T = TypeVar("T")


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


async def _until_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def cancel_on_disconnect(receive: Receive, work: Coroutine[Any, Any, T]) -> T:
    """``work``'s result, or ``ClientDisconnected`` once the client went away first.

    Nobody is left to read the answer, so the work is cancelled (as Envoy resets the upstream
    stream). Call it only after the body was read; a ``replay_receive`` never disconnects,
    so a keyed execution is never cut short this way.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_until_disconnect(receive))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientDisconnected
    return task.result()
