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


async def _cancel_at_disconnect(receive: Receive, task: asyncio.Task[Any]) -> None:
    try:
        await _until_disconnect(receive)
    finally:
        watcher = asyncio.current_task()
        # Cancelled itself: the work ended first. Anything else ends the work.
        if watcher is None or not watcher.cancelling():
            task.cancel()


async def cancel_on_disconnect(receive: Receive, work: Coroutine[Any, Any, T]) -> T:
    """``work``'s result, or ``ClientDisconnected`` once the client went away first.

    Nobody is left to read the answer, so the work is cancelled (as Envoy resets the upstream
    stream). Call it only after the body was read; a ``replay_receive`` never disconnects,
    so a keyed execution is never cut short this way.

    The work runs in the calling task and one watcher task cancels it at a disconnect, the
    way ``asyncio.timeout`` cancels at its deadline: a second task for the work and an
    ``asyncio.wait`` on both would cost more than the proxying they guard.
    """
    task = asyncio.current_task()
    assert task is not None, "cancel_on_disconnect runs inside a task"
    watcher = asyncio.ensure_future(_cancel_at_disconnect(receive, task))
    try:
        result = await work
    except asyncio.CancelledError:
        if watcher.done() and not watcher.cancelled() and task.uncancel() == 0:
            # The watcher's cancellation, and nobody else's pending: the client is gone.
            raise ClientDisconnected from None
        raise
    finally:
        if not watcher.done():
            watcher.cancel()
    if watcher.done() and not watcher.cancelled():
        # The work absorbed the watcher's cancellation and finished: withdraw the request,
        # so a later ``asyncio.timeout`` in this task still tells its own expiry apart.
        task.uncancel()
    return result
