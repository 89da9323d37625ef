"""Admin request bodies, bounded before they are read.

An admin request carries a few bytes of JSON. FastAPI reads and parses a body before the
token check runs, so without a bound anyone who reaches the admin port could make a worker
(which serves the proxy too) hold and parse a body of any size. A body over the bound is
refused with a 413 problem, token or not, having read no more than the bound.
"""

from __future__ import annotations

from idempotency_gateway.asgi import (
    ASGIApp,
    ClientDisconnected,
    Message,
    Receive,
    Scope,
    Send,
    read_body,
)
from idempotency_gateway.errors import RequestBodyTooLarge
from idempotency_gateway.problems import send_problem

MAX_ADMIN_BODY = 64 * 1024


class BoundedBodies:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            body = await read_body(receive, scope["headers"], limit=MAX_ADMIN_BODY)
        except RequestBodyTooLarge as error:
            await send_problem(send, error, request_id=None)
            return
        except ClientDisconnected:
            return
        await self.app(scope, _replaying(body, receive), send)


def _replaying(body: bytes, receive: Receive) -> Receive:
    """``receive`` that hands the body read first, then what comes after it."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay() -> Message:
        if pending:
            return pending.pop()
        return await receive()

    return replay
