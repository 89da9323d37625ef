"""Capturing the owner's response as it streams, and replaying a stored one."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from enum import Enum

from idempotency_gateway.asgi import Headers, Message, Send
from idempotency_gateway.config import ErrorFormat
from idempotency_gateway.errors import GatewayError, UpstreamInvalidResponse, is_final_status
from idempotency_gateway.problems import error_answer
from idempotency_gateway.storage.records import StoredResponse

log = logging.getLogger(__name__)

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


class Phase(Enum):
    """Where a captured answer stands. Only ``finish`` leaves the capturing phases."""

    AWAITING_HEAD = "awaiting head"  # the app has sent nothing yet
    STREAMING = "streaming"  # the head is in, the body is still coming
    COMPLETE = "complete"  # the app's whole answer is in; its end is held back
    # The app's head carried no final status: a 502 problem took its place (whole, its end
    # held back) and whatever the app sends after is dropped.
    REPLACED = "replaced"
    RELEASED = "released"  # finished: the client has its whole answer
    WITHDRAWN = "withdrawn"  # finished: the app's answer never reaches the client whole


_CAPTURING = frozenset({Phase.AWAITING_HEAD, Phase.STREAMING})
_WHOLE = frozenset({Phase.COMPLETE, Phase.REPLACED})


class ResponseCapture:
    """Wraps ``send``: the app's answer is teed for storage on its way to the client.

    An answer that fits the store (a Content-Length no larger than ``max_stored_body``) is
    held whole until ``finish``: the client gets nothing of it before its outcome is recorded,
    so an answer that cannot be recorded is replaced whole (by the answer of record or a
    problem), never cut short after its head. A streamed answer (no Content-Length) or one
    over the cap goes to the client as it comes; only the message that completes it (the end
    of the body, or the chunk that reaches its Content-Length) is held back until ``finish``:
    a client that has its whole answer may retry at once, and must then find the record
    final, not a 409.

    The client going away must not stop the execution, so a failing ``send`` only marks the
    client as gone; capture continues and the answer is still stored for the retry.
    """

    def __init__(
        self,
        send: Send,
        *,
        max_stored_body: int,
        error_format: ErrorFormat,
        replay_marker: bytes,
    ) -> None:
        self._send = send
        # The gateway's own fields on an answer (the route's replay marker, the body-omitted
        # flag): an application's answer carrying one (an upstream that keeps idempotency
        # records itself) would reach the client, and the record, as the gateway's word that
        # this is a replay, or that the stored body was left out.
        self._gateway_owned = frozenset({replay_marker, BODY_OMITTED_HEADER[0]})
        self._limit = max_stored_body
        self._error_format = error_format
        self.phase = Phase.AWAITING_HEAD
        self._chunks: list[bytes] = []
        self._size = 0
        self.status: int | None = None
        self.headers: Headers = []
        self.body_omitted = False
        # The client's connection, which fails independently of what the app sends.
        self.client_gone = False
        # The messages that would complete the client's answer, held back until finish().
        self._held: list[Message] = []
        self._declared_length: int | None = None
        self._body_seen = 0

    @property
    def started(self) -> bool:
        return self.status is not None

    @property
    def complete(self) -> bool:
        """The app's answer (or the problem that replaced it) is whole."""
        return self.phase in _WHOLE

    async def send(self, message: Message) -> None:
        if self.phase not in _CAPTURING:
            return
        if message["type"] == "http.response.start" and not is_final_status(message["status"]):
            await self._replace_invalid(message["status"])
            return
        if message["type"] == "http.response.start":
            self.phase = Phase.STREAMING
            self.status = message["status"]
            self.headers = [
                (name, value)
                for name, value in message.get("headers", [])
                if name.lower() not in self._gateway_owned
            ]
            message = {**message, "headers": self.headers}
            self._declared_length = _content_length(self.headers)
            fits = self._declared_length is not None and self._declared_length <= self._limit
            if fits or self.status in (204, 304):
                # Held whole (every later message joins the held head); a bodiless answer
                # is whole with its head.
                self._held.append(message)
                return
        elif message["type"] == "http.response.body":
            body = message.get("body", b"")
            self._tee(body)
            self._body_seen += len(body)
            if not message.get("more_body", False):
                self.phase = Phase.COMPLETE
            # With Content-Length framing the chunk that reaches the length already completes
            # the answer for the client, before the empty closing message arrives.
            if self.complete or self._held or self._body_seen == self._declared_length:
                self._held.append(message)
                return
        await self._forward(message)

    async def _replace_invalid(self, status: object) -> None:
        """A status no client can be given (the server would write a broken head, and every
        replay would break again): the answer becomes a 502 problem, stored as such."""
        error = UpstreamInvalidResponse(
            f"the application answered with status {status!r}, which is not a final HTTP "
            "status; the request may or may not have been processed"
        )
        log.error("replacing an invalid response status: %s", error.detail)
        problem = stored_problem(error, request_id=None, error_format=self._error_format)
        await send_stored(self.send, problem, replayed=None)
        self.phase = Phase.REPLACED

    async def finish(
        self,
        *,
        recorded: bool,
        instead: StoredResponse,
        replayed: tuple[bytes, bytes] | None = None,
    ) -> None:
        """End the client's answer, once the record's outcome is settled; call exactly once.

        ``recorded``: what was held back goes out; an app that never answered is answered
        with ``instead``. Not recorded: the answer is never completed. Before its head went
        out (always, for an answer held whole) the client gets ``instead``, marked as a
        replay with the ``replayed`` field when given; after, a streamed answer stays cut
        short (the server closes the connection), so the client cannot mistake it for a
        whole one and retries."""
        assert self.phase not in (Phase.RELEASED, Phase.WITHDRAWN), "finished twice"
        head_sent = self.started and not any(
            message["type"] == "http.response.start" for message in self._held
        )
        held, self._held = self._held, []
        self.phase = Phase.RELEASED if recorded else Phase.WITHDRAWN
        if recorded and self.started:
            for message in held:
                await self._forward(message)
        elif not head_sent:
            await send_stored(self._forward, instead, replayed=replayed)

    async def _forward(self, message: Message) -> None:
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

    def kept_headers(self) -> Headers:
        """The answer's fields as every replay repeats them (framing made anew)."""
        return [(name, value) for name, value in self.headers if name.lower() not in _NOT_STORED]

    def stored_response(self) -> StoredResponse:
        assert self.status is not None, "no response was started"
        headers = [
            (name.decode("latin-1"), value.decode("latin-1")) for name, value in self.kept_headers()
        ]
        body = b"" if self.body_omitted else b"".join(self._chunks)
        return StoredResponse(self.status, headers, body, self.body_omitted)


def _content_length(headers: Headers) -> int | None:
    for name, value in headers:
        if name.lower() == b"content-length":
            return int(value) if value.isdigit() else None
    return None


def stored_problem(
    error: GatewayError, request_id: str | None, error_format: ErrorFormat
) -> StoredResponse:
    """An error answer in the form the store keeps, for answers the gateway makes itself."""
    status, raw_headers, body = error_answer(
        error, request_id=request_id, error_format=error_format
    )
    headers = [
        (name.decode(), value.decode()) for name, value in raw_headers if name != b"content-length"
    ]
    return StoredResponse(status, headers, body)


async def send_stored(
    send: Send,
    response: StoredResponse,
    *,
    replayed: tuple[bytes, bytes] | None,
    extra: Sequence[tuple[bytes, bytes]] = (),
    pieces: Sequence[bytes] | None = None,
) -> None:
    """Send a stored answer; ``replayed`` is the route's replay marker field when it is one.
    ``pieces``: the body to send instead, one message each (a stream's events)."""
    pieces = (response.body,) if pieces is None else pieces
    headers: Headers = [*response.wire_headers()]
    headers.append((b"content-length", str(sum(map(len, pieces))).encode()))
    if replayed is not None:
        headers.append(replayed)
    if response.body_omitted:
        headers.append(BODY_OMITTED_HEADER)
    headers.extend(extra)
    await send({"type": "http.response.start", "status": response.status, "headers": headers})
    for piece in pieces[:-1]:
        await send({"type": "http.response.body", "body": piece, "more_body": True})
    last = pieces[-1] if pieces else b""
    await send({"type": "http.response.body", "body": last, "more_body": False})
