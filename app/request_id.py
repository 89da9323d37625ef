"""``X-Request-Id``: kept when the client sends one, generated otherwise.

The id is written into the request headers (so the upstream and problem bodies carry it) and
echoed on the response, so one id follows a request through every log line.
"""

from __future__ import annotations

import re
import uuid

from app.asgi import ASGIApp, Message, Receive, Scope, Send, first_header

REQUEST_ID_HEADER = b"x-request-id"
# A client-chosen id ends up in logs and upstream headers: accept only a tame shape.
_ACCEPTABLE_ID = re.compile(rb"^[A-Za-z0-9._:-]{1,128}$")


def request_id_of(scope: Scope) -> str | None:
    value = first_header(scope["headers"], REQUEST_ID_HEADER)
    return value.decode("ascii") if value is not None else None


class RequestIdMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        incoming = first_header(scope["headers"], REQUEST_ID_HEADER)
        if incoming is not None and _ACCEPTABLE_ID.match(incoming):
            request_id = incoming
        else:
            request_id = uuid.uuid4().hex.encode()
            scope["headers"] = [
                (name, value) for name, value in scope["headers"] if name != REQUEST_ID_HEADER
            ]
            scope["headers"].append((REQUEST_ID_HEADER, request_id))

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k != REQUEST_ID_HEADER]
                headers.append((REQUEST_ID_HEADER, request_id))
                message["headers"] = headers
            await send(message)

        await self.app(scope, receive, send_with_id)
