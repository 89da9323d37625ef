"""Capturing the owner's response as it streams, and replaying a stored one."""

from __future__ import annotations

import logging

from app.asgi import Headers, Message, Send
from app.idempotency.record import StoredResponse

log = logging.getLogger(__name__)

REPLAYED_HEADER = (b"idempotent-replayed", b"true")
BODY_OMITTED_HEADER = (b"idempotency-body-omitted", b"true")

# Framing and per-response fields are made anew for every answer, never replayed.
_NOT_STORED = frozenset(
    {
        b"content-length",
        b"transfer-encoding",
        b"connection",
        b"keep-alive",
        b"date",
        b"server",
        b"x-request-id",
    }
)


class ResponseCapture:
    """Wraps ``send``: every message goes to the client at once and is teed for storage.

    The client going away must not stop the execution, so a failing ``send`` only marks the
    client as gone; capture continues and the answer is still stored for the retry.
    """

    def __init__(self, send: Send, *, max_stored_body: int) -> None:
        self._send = send
        self._limit = max_stored_body
        self._chunks: list[bytes] = []
        self._size = 0
        self.status: int | None = None
        self.headers: Headers = []
        self.body_omitted = False
        self.complete = False
        self.client_gone = False

    @property
    def started(self) -> bool:
        return self.status is not None

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            self.headers = list(message.get("headers", []))
        elif message["type"] == "http.response.body":
            self._tee(message.get("body", b""))
            if not message.get("more_body", False):
                self.complete = True
        if self.client_gone:
            return
        try:
            await self._send(message)
        except Exception:  # whatever the server raises for a closed connection
            log.info("client went away; the execution continues and will be stored")
            self.client_gone = True

    def _tee(self, chunk: bytes) -> None:
        if self.body_omitted or not chunk:
            return
        self._size += len(chunk)
        if self._size > self._limit:
            # Still delivered to the client; only the stored copy is given up.
            self.body_omitted = True
            self._chunks.clear()
            return
        self._chunks.append(chunk)

    def stored_response(self) -> StoredResponse:
        assert self.status is not None, "no response was started"
        headers = [
            (name.decode("latin-1"), value.decode("latin-1"))
            for name, value in self.headers
            if name.lower() not in _NOT_STORED
        ]
        body = b"" if self.body_omitted else b"".join(self._chunks)
        return StoredResponse(self.status, headers, body, self.body_omitted)


async def send_stored(send: Send, response: StoredResponse, *, replayed: bool) -> None:
    headers: Headers = [
        (name.encode("latin-1"), value.encode("latin-1")) for name, value in response.headers
    ]
    headers.append((b"content-length", str(len(response.body)).encode()))
    if replayed:
        headers.append(REPLAYED_HEADER)
    if response.body_omitted:
        headers.append(BODY_OMITTED_HEADER)
    await send({"type": "http.response.start", "status": response.status, "headers": headers})
    await send({"type": "http.response.body", "body": response.body, "more_body": False})
