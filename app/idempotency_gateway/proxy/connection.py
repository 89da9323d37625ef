"""One keep-alive HTTP/1.1 connection to an upstream: an asyncio protocol around httptools.

httptools (llhttp, the parser uvicorn serves with) does the framing: status line, fields,
``Content-Length``, chunked coding, bodies that 1xx/204/304 answers never have, keep-alive.
This module only keeps one exchange's state, its deadlines (loop timers that abort the
transport when they fire) and the flow control of a body the consumer reads slower than it
arrives. It never writes a request twice: what happens after a failure is the caller's
decision.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import Callable
from typing import cast

import httptools

from idempotency_gateway.errors import (
    UpstreamConnectionLost,
    UpstreamError,
    UpstreamInvalidResponse,
    UpstreamNotSent,
    UpstreamTimeout,
)

# Unread body bytes above which the socket is no longer read until the consumer catches up:
# a large answer streams through a bounded buffer instead of piling up in memory.
READ_BUFFER_HIGH = 256 * 1024
# Read straight into one buffer per connection (BufferedProtocol): the parser copies a body
# out of it once, instead of once more from a fresh bytes object per read.
READ_SIZE = 64 * 1024
# The most a response head (interim answers included) may take: llhttp has no bound of its
# own, and an upstream streaming fields forever must not grow the worker's memory with them.
# The same bound holds for what may arrive between two pieces of body: chunk framing and
# extensions, and the trailer section after the last chunk.
MAX_HEAD = 64 * 1024
_FRAMING_FIELDS = (b"content-length", b"transfer-encoding")
# TLS alerts a server sends only while the handshake is being settled. In TLS 1.3 the server
# judges the client's certificate after the client's side of the handshake is done and the
# request written: the refusal arrives as one of these instead of an answer. The request
# never reached the upstream's application (it cannot read a byte before the handshake).
_HANDSHAKE_REFUSALS = frozenset(
    {
        "TLSV13_ALERT_CERTIFICATE_REQUIRED",
        "SSLV3_ALERT_BAD_CERTIFICATE",
        "SSLV3_ALERT_UNSUPPORTED_CERTIFICATE",
        "SSLV3_ALERT_CERTIFICATE_REVOKED",
        "SSLV3_ALERT_CERTIFICATE_EXPIRED",
        "SSLV3_ALERT_CERTIFICATE_UNKNOWN",
        "TLSV1_ALERT_UNKNOWN_CA",
        "TLSV1_ALERT_ACCESS_DENIED",
        "SSLV3_ALERT_HANDSHAKE_FAILURE",
        "TLSV1_ALERT_DECRYPT_ERROR",
    }
)
# uvloop's clock ticks in milliseconds: a timer may fire that much before its deadline.
_TIMER_SLACK = 0.001


def connection_lost(upstream: str, why: str) -> UpstreamConnectionLost:
    return UpstreamConnectionLost(
        f"the connection to upstream {upstream!r} broke before a complete answer ({why}); "
        "the request may or may not have been processed"
    )


def timed_out(upstream: str, what: str) -> UpstreamTimeout:
    return UpstreamTimeout(
        f"upstream {upstream!r} did not answer in time ({what}); the request may or may not "
        "have been processed"
    )


class UnaskedAnswer(Exception):
    """An answer began after the exchange's answer was complete."""


class UnrelayableAnswer(Exception):
    """The answer's body is in a transfer coding the gateway cannot pass on."""


class UpstreamConnection(asyncio.BufferedProtocol):
    """Carries one exchange at a time: ``send``, then ``head()``, then ``take``/``more`` for
    the body. ``idle`` is true while the pool holds it; ``on_idle_close`` is how the pool
    learns that the upstream closed it then."""

    def __init__(self, upstream: str, on_idle_close: Callable[[UpstreamConnection], None]) -> None:
        self.upstream = upstream
        self._on_idle_close = on_idle_close
        self._loop = asyncio.get_running_loop()
        self._parser = httptools.HttpResponseParser(self)
        # A Content-Length among the trailer fields is no framing (the body has ended): llhttp
        # would fail the whole answer on it. The head's framing is checked in
        # on_headers_complete instead.
        self._parser.set_dangerous_leniencies(lenient_chunked_length=True)
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle = False
        self.idle_since = 0.0
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.head_done = False
        self.complete = False
        self.keep_alive = False
        self.error: UpstreamError | None = None
        self._head_only = False
        self._head_bytes = 0
        # Bytes received since the last read that carried body (chunk framing, trailers).
        self._framing_bytes = 0
        self._body_in_read = False
        # A trailer field was parsed: the last chunk is in, the body whole whatever follows.
        self._in_trailers = False
        self._body: deque[bytes] = deque()
        self._buffered = 0
        self._paused = False
        self._waiter: asyncio.Future[None] | None = None
        # One deadline at a time (the head's, then each silence mid-body), behind one timer.
        self._deadline: float | None = None
        self._deadline_what = ""
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self._read_buffer = memoryview(bytearray(READ_SIZE))

    # ------------------------------------------------------------------ the exchange

    def send(self, data: bytes, *, head_deadline: float, head_only: bool) -> None:
        """Write the whole request (head and body in one write) and start the head's timer.

        ``head_only``: a HEAD request, whose answer has no body whatever its fields say."""
        self.head_done = self.complete = self.keep_alive = False
        self.error = None
        self._head_only = head_only
        self._head_bytes = self._framing_bytes = 0
        self._in_trailers = False
        self._set_deadline(head_deadline, "no response head")
        cast(asyncio.Transport, self.transport).write(data)

    async def head(self) -> None:
        """Until the final answer's head arrived; the exchange's ``UpstreamError`` otherwise."""
        while not self.head_done:
            if self.error is not None:
                raise self.error
            waiter = self._waiter = self._loop.create_future()
            await waiter

    @property
    def has_body(self) -> bool:
        return bool(self._body)

    @property
    def buffered(self) -> int:
        return self._buffered

    def take(self) -> bytes:
        """The oldest body bytes received and not yet taken, as they came (no copy); reading
        resumes once the consumer took all that had piled up."""
        body = self._body
        data = body.popleft()
        self._buffered -= len(data)
        if self._paused and not body:
            self._paused = False
            cast(asyncio.Transport, self.transport).resume_reading()
        return data

    async def more(self, silence: float) -> None:
        """Until more body, its end, or a failure; at most ``silence`` seconds of nothing."""
        if self.error is None:
            self._set_deadline(self._loop.time() + silence, "silence mid-body")
            waiter = self._waiter = self._loop.create_future()
            try:
                await waiter
            finally:
                self._deadline = None
        if not self._body and self.error is not None:
            raise self.error

    def close(self) -> None:
        """Gracefully when the exchange is complete, at once (abort) otherwise."""
        self._cancel_timer()
        self.closed = True
        if self.transport is not None:
            if self.complete:
                self.transport.close()
            else:
                self.transport.abort()

    def make_idle(self, now: float) -> None:
        """Between exchanges: what the last answer's consumer left unread is dropped, and
        reading goes on, so an upstream closing the connection is seen at once."""
        self.idle = True
        self.idle_since = now
        self._body.clear()
        self._buffered = 0
        if self._paused:
            self._paused = False
            cast(asyncio.Transport, self.transport).resume_reading()

    # ---------------------------------------------------------------- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._read_buffer

    def buffer_updated(self, nbytes: int) -> None:
        self._body_in_read = False
        head_was_done = self.head_done
        try:
            self._parser.feed_data(self._read_buffer[:nbytes])
        except httptools.HttpParserUpgrade:
            pass  # a 101: the head is done and the connection is never reused
        except httptools.HttpParserError as exc:
            self._cut(f"invalid HTTP: {exc}")
        if not self.head_done:
            self._head_bytes += nbytes
            if self._head_bytes > MAX_HEAD:
                self._cut(f"a head over {MAX_HEAD} bytes")
        elif head_was_done and not self.complete:
            # The read that ended the head is the head's, whatever else it held.
            self._framing_bytes = 0 if self._body_in_read else self._framing_bytes + nbytes
            if self._framing_bytes > MAX_HEAD:
                self._cut(f"over {MAX_HEAD} bytes of chunk framing or trailer fields")
        if self.head_done or self.error is not None:
            self._wake()

    def eof_received(self) -> bool | None:
        self.closed = True
        return None  # the transport closes itself; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._cancel_timer()
        if self.idle:
            self._on_idle_close(self)
            return
        if self._in_trailers:
            self.complete = True  # the body is whole: only trailer fields were still coming
        elif (
            isinstance(exc, ssl.SSLError)
            and exc.reason in _HANDSHAKE_REFUSALS
            # Nothing of an answer: the handshake was never accepted.
            and not self.head_done
            and not self._head_bytes
        ):
            self._fail(
                UpstreamNotSent(
                    f"upstream {self.upstream!r} refused the TLS handshake ({exc.reason}); "
                    "nothing was sent"
                )
            )
        elif (
            exc is None
            and self.error is None
            and self.head_done
            and not self.complete
            and self._delimited_by_close()
        ):
            # Only an orderly close ends an answer delimited by closing: a reset cuts it
            # short, and so does an abort of ours after a failure.
            self.complete = True
        else:
            self._fail(connection_lost(self.upstream, str(exc or "closed by the upstream")))
        self._wake()

    # ------------------------------------------------------------- parser callbacks

    def on_message_begin(self) -> None:
        if self.complete:
            # An answer nobody asked for (after the whole answer, or on an idle connection: a
            # 408 before the upstream closes it, say) puts the upstream out of step with the
            # exchanges: the connection closes (the parser error is the way out).
            raise UnaskedAnswer
        self.headers = []

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.head_done:
            # A trailer field (after a chunked body): dropped. The answer's fields were taken
            # with its head, to be relayed and stored; a trailer must not add a Set-Cookie,
            # an Idempotent-Replayed or a Content-Length to them afterwards.
            self._in_trailers = True
            return
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if 100 <= status < 200 and status != 101:
            return  # interim (100 Continue, 103 Early Hints): the final answer follows
        if not self._head_only and not self._framed_plainly():
            self._fail(
                UpstreamInvalidResponse(
                    f"upstream {self.upstream!r} framed its answer in a transfer coding other "
                    "than chunked, or with both Transfer-Encoding and Content-Length, which "
                    "the gateway cannot pass on; the request may or may not have been processed"
                )
            )
            raise UnrelayableAnswer
        self.status = status
        self.head_done = True
        self._deadline = None
        if self._head_only or status == 101:
            # HEAD: llhttp cannot be told to skip the body a Content-Length announces, so the
            # answer ends here and the connection, mid-message for the parser, is not reused.
            # 101: what follows is no longer HTTP.
            self.complete = True

    def on_body(self, body: bytes) -> None:
        if self.complete:
            return  # bytes after a HEAD answer's head, on a connection that closes
        self._body_in_read = True
        self._body.append(body)
        self._buffered += len(body)
        if self._buffered > READ_BUFFER_HIGH and not self._paused:
            self._paused = True
            cast(asyncio.Transport, self.transport).pause_reading()

    def on_message_complete(self) -> None:
        if not self.head_done or self.complete:
            return  # an interim answer, or the rest of a HEAD answer
        self.complete = True
        self.keep_alive = self._parser.should_keep_alive()

    # ----------------------------------------------------------------------- inner

    def _framed_plainly(self) -> bool:
        """No transfer coding but chunked (RFC 9112 section 6.1), and not beside a length.
        The gateway sends no ``TE``: ``gzip, chunked`` would reach the client as a body it
        cannot decode, and ``chunked, gzip`` is delimited by closing, the gzip bytes taken as
        the content. Both fields at once (which the parser is told to let through, for the
        sake of trailers) is how responses are split (section 6.3)."""
        codings: list[bytes] = []
        length = False
        for name, value in self.headers:
            if name == b"transfer-encoding":
                codings += (coding.strip().lower() for coding in value.split(b","))
            elif name == b"content-length":
                length = True
        return not codings or (codings == [b"chunked"] and not length)

    def _delimited_by_close(self) -> bool:
        """An answer with neither Content-Length nor chunked coding ends when the
        connection does (RFC 9112 section 6.3): losing the connection completes it. Any
        ``Transfer-Encoding`` here is chunked (``_framed_plainly``)."""
        return not any(name in _FRAMING_FIELDS for name, _ in self.headers)

    def _cut(self, why: str) -> None:
        """Stop reading the answer and drop the connection. Once in the trailer section the
        answer is complete (its body is whole; trailers are dropped anyway), before it the
        exchange failed."""
        if self._in_trailers:
            self.complete = True
        else:
            self._fail(connection_lost(self.upstream, why))
        self._abort()

    def _fail(self, error: UpstreamError) -> None:
        if self.error is None and not self.complete:
            self.error = error

    def _set_deadline(self, when: float, what: str) -> None:
        """Arm the exchange's deadline. The loop timer is not moved for every exchange: one
        due no later than ``when`` fires, finds the deadline it should wait for and re-arms,
        so a busy connection costs a timer per deadline period rather than per request."""
        self._deadline = when
        self._deadline_what = what
        timer = self._timer
        if timer is None or self._timer_at > when:
            if timer is not None:
                timer.cancel()
            self._timer = self._loop.call_at(when, self._on_timer)
            self._timer_at = when

    def _on_timer(self) -> None:
        self._timer = None
        deadline = self._deadline
        if deadline is None:
            return
        if deadline > self._loop.time() + _TIMER_SLACK:
            self._timer = self._loop.call_at(deadline, self._on_timer)
            self._timer_at = deadline
            return
        self._deadline = None
        self._fail(timed_out(self.upstream, self._deadline_what))
        self._abort()
        self._wake()

    def _abort(self) -> None:
        """Drop the connection at once. ``closed`` is set here rather than when
        ``connection_lost`` follows (a loop iteration later): until then the pool would still
        hand it out, and a request written to it would be lost unsent yet reported as maybe
        processed."""
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)
