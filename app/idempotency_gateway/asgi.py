"""ASGI type aliases and the few header helpers every layer needs."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine, MutableMapping
from typing import Any, Protocol, TypeVar

from idempotency_gateway.errors import RequestBodyTooLarge

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


class _ReplayedBody:
    """A ``receive`` that hands an already-read body to the next app, then waits for nothing."""

    __slots__ = ("_body",)

    def __init__(self, body: bytes) -> None:
        self._body: bytes | None = body

    async def __call__(self) -> Message:
        body, self._body = self._body, None
        if body is not None:
            return {"type": "http.request", "body": body, "more_body": False}
        # After the body the only thing an app can wait for is a disconnect; the owner's
        # execution must never be cut short by one, so it never comes.
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


def replay_receive(body: bytes) -> Receive:
    return _ReplayedBody(body)


class ClientDisconnected(Exception):
    """The client went away before its request body arrived."""


async def read_body(receive: Receive, headers: Headers, *, limit: int) -> bytes:
    """The whole request body, refusing more than ``limit`` bytes before reading them all."""
    declared = first_header(headers, b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnected
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        if not message.get("more_body", False):
            # Most bodies arrive in one message: no join, no copy.
            return b"".join((*chunks, chunk)) if chunks else chunk
        chunks.append(chunk)


def _too_large(limit: int) -> RequestBodyTooLarge:
    return RequestBodyTooLarge(f"the request body is larger than {limit} bytes")


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


# The ASGI scope extension through which a server reports a lost connection by callback,
# sparing a watcher task per request (``server.protocol.EdgeProtocol`` offers it): a dict
# whose ``"signal"`` is a ``DisconnectSignal``.
DISCONNECT_EXTENSION = "idempotency_gateway.disconnect"


class DisconnectSignal(Protocol):
    def reports_for(self, receive: Receive) -> bool:
        """Whether a disconnect seen through ``receive`` is this connection's loss: true for
        the server's own ``receive``, false for a ``replay_receive`` that never disconnects."""
        ...

    def add(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once when the connection is lost (at once if it already is)."""
        ...

    def discard(self, callback: Callable[[], None]) -> None: ...


def _disconnect_signal(scope: Scope, receive: Receive) -> DisconnectSignal | None:
    extensions = scope.get("extensions")
    extension = extensions.get(DISCONNECT_EXTENSION) if extensions else None
    if extension is None:
        return None
    signal: DisconnectSignal = extension["signal"]
    return signal if signal.reports_for(receive) else None


async def cancel_on_disconnect(scope: Scope, receive: Receive, work: Coroutine[Any, Any, T]) -> T:
    """``work``'s result, or ``ClientDisconnected`` once the client went away first.

    Nobody is left to read the answer, so the work is cancelled (as Envoy resets the upstream
    stream). Call it only after the body was read; a ``replay_receive`` never disconnects,
    so a keyed execution is never cut short this way.

    The work runs in the calling task, cancelled at a disconnect the way ``asyncio.timeout``
    cancels at its deadline: by the server's disconnect callback where it offers one, else
    by one watcher task waiting on ``receive``. A second task for the work and an
    ``asyncio.wait`` on both would cost more than the proxying they guard.
    """
    task = asyncio.current_task()
    assert task is not None, "cancel_on_disconnect runs inside a task"
    disconnected, stop_watching = _watch_disconnect(scope, receive, task)
    try:
        result = await work
    except asyncio.CancelledError:
        if disconnected() and task.uncancel() == 0:
            # The disconnect's cancellation, and nobody else's pending: the client is gone.
            raise ClientDisconnected from None
        raise
    finally:
        stop_watching()
    if disconnected():
        # The work absorbed the disconnect's cancellation and finished: withdraw the request,
        # so a later ``asyncio.timeout`` in this task still tells its own expiry apart.
        task.uncancel()
    return result


def _watch_disconnect(
    scope: Scope, receive: Receive, task: asyncio.Task[Any]
) -> tuple[Callable[[], bool], Callable[[], None]]:
    """Cancel ``task`` at the client's disconnect; returns whether that happened, and how to
    stop watching."""
    if isinstance(receive, _ReplayedBody):
        # It never reports a disconnect: a watcher would wait for nothing, then be cancelled
        # (a task, and its cancellation's traceback left for the collector, per keyed request).
        return _never, _nothing_to_stop
    signal = _disconnect_signal(scope, receive)
    if signal is not None:
        seen = False

        def on_disconnect() -> None:
            nonlocal seen
            seen = True
            task.cancel()

        signal.add(on_disconnect)
        return (lambda: seen), (lambda: signal.discard(on_disconnect))
    watcher = asyncio.ensure_future(_cancel_at_disconnect(receive, task))

    def stop() -> None:
        if not watcher.done():
            watcher.cancel()

    return (lambda: watcher.done() and not watcher.cancelled()), stop


def _never() -> bool:
    return False


def _nothing_to_stop() -> None:
    pass
