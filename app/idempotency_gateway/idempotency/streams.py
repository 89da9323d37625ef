"""Event streams on a ``streaming: {follow: true}`` route: docs/CONTRACT.md, "Event streams
that survive a dropped connection".

The owner's streamed ``text/event-stream`` answer goes live (``replay.live_streams``) event
by event, each handed over before the owner's client has it (in process it is there at once;
through Redis its append is on its way). A duplicate of the same request gets the
events so far and follows the rest; a finished stream replays event by event. Both start
after the duplicate's ``Last-Event-ID`` (``sse.ResumeAfter``). The upstream's bytes are never
rewritten: the gateway adds no ``id:`` lines.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

from idempotency_gateway.asgi import Message, Scope, Send
from idempotency_gateway.config import IdempotencyConfig
from idempotency_gateway.idempotency.responses import ResponseCapture, send_stored
from idempotency_gateway.idempotency.sse import EventSplitter, ResumeAfter, split_events
from idempotency_gateway.replay.live_streams import (
    LiveFollower,
    LivePublisher,
    LiveStreams,
    StreamEnd,
    StreamHead,
)
from idempotency_gateway.storage.records import RecordKey, StoredResponse

# An SSE comment: every client's parser skips it; a person reading the stream sees why it
# stopped. The connection then closes without the body's end, so no client takes it as whole.
CUT_NOTICE = (
    b": the gateway cut this stream here; retry with the same Idempotency-Key and "
    b"Last-Event-ID for the rest\n\n"
)


def is_event_stream(headers: Iterable[tuple[bytes, bytes]]) -> bool:
    """An event stream whose events the gateway can see. A compressed one (its bytes are the
    compressor's, not events) is neither followed (a 409, as on any route) nor replayed
    event by event (whole, as any answer)."""
    fields = {name.lower(): value.partition(b";")[0].strip().lower() for name, value in headers}
    return (
        fields.get(b"content-type") == b"text/event-stream"
        and fields.get(b"content-encoding", b"identity") == b"identity"
    )


def resume_of(scope: Scope) -> ResumeAfter:
    for name, value in scope["headers"]:
        if name == b"last-event-id":
            # Empty is the SSE reset's "no last event" (browsers then send no field at all),
            # never an id to skip everything after.
            return ResumeAfter(value.strip() or None)
    return ResumeAfter(None)


class StreamTee:
    """Sits in front of the owner's ``ResponseCapture``: a streamed event-stream answer (no
    Content-Length) is published to the live streams as well."""

    def __init__(
        self,
        capture: ResponseCapture,
        live: LiveStreams,
        *,
        key: RecordKey,
        request_hash: str,
        config: IdempotencyConfig,
    ) -> None:
        self._capture, self._live = capture, live
        self._key, self._request_hash, self._config = key, request_hash, config
        self._publisher: LivePublisher | None = None
        self._splitter = EventSplitter()
        # Where the app sends its answer: through the tee only where streams are followed.
        self.send: Send = self._tee if config.streaming.follow else capture.send

    async def _tee(self, message: Message) -> None:
        capture = self._capture
        if message["type"] == "http.response.start":
            await capture.send(message)
            if (
                capture.status is not None
                and is_event_stream(capture.headers)
                and not any(name.lower() == b"content-length" for name, _ in capture.headers)
            ):
                head = StreamHead(self._request_hash, capture.status, capture.kept_headers())
                self._publisher = self._live.publish(
                    self._key,
                    head,
                    max_bytes=self._config.max_stored_body,
                    idle=self._config.streaming.idle,
                )
            return
        if self._publisher is not None and message["type"] == "http.response.body":
            for raw in self._splitter.feed(message.get("body", b"")):
                self._publisher.event(raw)
            if not message.get("more_body", False) and (rest := self._splitter.flush()):
                self._publisher.event(rest)
        await capture.send(message)

    def end(self, *, recorded: bool) -> None:
        """After the finalize: followers get the end only of an answer the record holds."""
        if self._publisher is not None:
            self._publisher.end(StreamEnd.RECORDED if recorded else StreamEnd.CUT)


async def follow_live(
    live: LiveStreams,
    send: Send,
    *,
    key: RecordKey,
    request_hash: str,
    scope: Scope,
    config: IdempotencyConfig,
    marker: tuple[bytes, bytes],
) -> bool:
    """Answer a duplicate from the key's live stream; false when there is none to follow."""
    follower = await live.follow(key, request_hash, idle=config.streaming.idle)
    if follower is None:
        return False
    with contextlib.suppress(Exception):  # whatever the server raises for a closed connection
        await _send_followed(send, follower, resume_of(scope), marker)
    return True


async def _send_followed(
    send: Send, follower: LiveFollower, resume: ResumeAfter, marker: tuple[bytes, bytes]
) -> None:
    head = follower.head
    await send(
        {"type": "http.response.start", "status": head.status, "headers": [*head.headers, marker]}
    )
    async with contextlib.aclosing(follower.events()) as events:
        async for raw in events:
            if resume.keep(raw):
                await send({"type": "http.response.body", "body": raw, "more_body": True})
    if follower.ended is StreamEnd.RECORDED:
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    else:
        await send({"type": "http.response.body", "body": CUT_NOTICE, "more_body": True})


async def send_replay(
    send: Send,
    response: StoredResponse,
    *,
    scope: Scope,
    config: IdempotencyConfig,
    replayed: tuple[bytes, bytes],
    extra: Iterable[tuple[bytes, bytes]] = (),
) -> None:
    """A stored answer replayed; a stored event stream on a following route event by event,
    after the client's ``Last-Event-ID``."""
    if not config.streaming.follow or not is_event_stream(response.wire_headers()):
        await send_stored(send, response, replayed=replayed, extra=list(extra))
        return
    resume = resume_of(scope)
    events = [raw for raw in split_events(response.body) if resume.keep(raw)]
    await send_stored(send, response, replayed=replayed, extra=list(extra), pieces=events)
