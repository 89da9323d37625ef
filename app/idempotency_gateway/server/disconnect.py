"""The connection's loss, reported by callback to the request that waits on its upstream.

Offered in each request's scope under ``asgi.DISCONNECT_EXTENSION``: ``cancel_on_disconnect``
then cancels the upstream wait from ``connection_lost`` itself instead of keeping a watcher
task per request parked on ``receive``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from idempotency_gateway.asgi import Receive


class ConnectionLoss:
    """One per connection, shared by the requests on it (pipelined ones included)."""

    __slots__ = ("_callbacks", "lost")

    def __init__(self) -> None:
        self._callbacks: list[Callable[[], None]] = []
        self.lost = False

    def reports_for(self, receive: Receive) -> bool:
        # The server's own receive, a bound method of a request cycle on this connection;
        # anything else (a replay_receive) does not end with this connection.
        return isinstance(getattr(receive, "__self__", None), RequestResponseCycle)

    def add(self, callback: Callable[[], None]) -> None:
        if self.lost:
            callback()
        else:
            self._callbacks.append(callback)

    def discard(self, callback: Callable[[], None]) -> None:
        with contextlib.suppress(ValueError):  # already called
            self._callbacks.remove(callback)

    def connection_lost(self) -> None:
        self.lost = True
        callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()
