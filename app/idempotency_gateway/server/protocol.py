"""``EdgeProtocol``: uvicorn's httptools protocol, bounded against slow and oversized clients.

- The request head (request line and fields) is capped in bytes and in field count: 431.
- The head must arrive within ``request_head_timeout`` of the connection opening (or of the
  first byte of a later request on it), the body within ``request_body_timeout`` of the
  head's end: 408. Both answers close the connection.
- Beyond ``max_connections`` proxy connections per worker a new one gets a 503 problem and
  is closed; the admin listener has its own budget (``max_admin_connections``), so a flood
  of proxy connections never fails the liveness probe of a healthy worker.
- Request trailer fields (after a chunked body) are never header fields: they are counted
  against the head's limits and dropped, whether or not they arrive in the same read as the
  head; what follows a chunk size line is bounded as a head is (``chunks.ChunkWatch``).
- An absolute-form target's authority replaces ``Host`` (RFC 9112 section 3.2.2).
- An ``Upgrade`` offer is ignored (RFC 9110 section 7.8 lets a server do so): llhttp stops
  at the head of such a request and hands everything after it back as "the new protocol",
  so the head is re-read without the offer and the body is framed as for any request. The
  connection closes after that answer, so nothing the client sends next is read as HTTP.
- HTTP/1.0 clients never get chunked coding: an answer without Content-Length is
  delimited by closing the connection (RFC 9112 section 6.1), or cut by a reset.
- Refusing a request by its head while the client still sends its body (or an app's answer
  that closes the connection before the body ends), the server lingers: the answer goes
  out, the write side is shut, and what the client sends is read and dropped until it ends
  or ``LINGER_SECONDS`` pass. Closing with unread data would
  reset the connection, and a reset can destroy the answer before the client reads it.

Two savings on every request: the connection's loss is reported by callback
(``disconnect.ConnectionLoss``, so no watcher task waits on ``receive``), and the response
head goes out in one write with the first body bytes (``joined_writes.HeadWithBody``).
"""

from __future__ import annotations

import asyncio
import enum
import functools
import math
import weakref
from dataclasses import dataclass
from typing import Any

import httptools
import uvicorn
from uvicorn._types import ASGI3Application
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle
from uvicorn.server import ServerState

from idempotency_gateway.asgi import DISCONNECT_EXTENSION
from idempotency_gateway.config import LimitsConfig
from idempotency_gateway.errors import (
    GatewayError,
    MalformedRequest,
    RequestHeadTooLarge,
    RequestTimeout,
    TooManyConnections,
    TunnelRefused,
)
from idempotency_gateway.server.chunks import ChunkWatch
from idempotency_gateway.server.disconnect import ConnectionLoss
from idempotency_gateway.server.http10 import close_delimited
from idempotency_gateway.server.joined_writes import HeadWithBody
from idempotency_gateway.server.message import absolute_form, check_request_head
from idempotency_gateway.server.raw import closing_problem, head_without_upgrade

# Per field: the ": " between name and value and the CRLF that ends the line.
_FIELD_OVERHEAD = 4
# How long a refused client may go on sending before its connection is closed anyway.
LINGER_SECONDS = 2.0


class _Pending(enum.Enum):
    NOTHING = enum.auto()
    HEAD = enum.auto()
    BODY = enum.auto()


@dataclass
class _AdminConnections:
    open: int = 0


# Per server (its protocols share one ``ServerState``): the connections open on the admin
# listener. The proxy's are the rest of ``ServerState.connections``.
_ADMIN_CONNECTIONS: weakref.WeakKeyDictionary[ServerState, _AdminConnections] = (
    weakref.WeakKeyDictionary()
)


class EdgeServerConfig(uvicorn.Config):
    """uvicorn's config plus the gateway's limits and the admin listener's port (a
    module-level class, so ``--workers`` can hand it to worker processes)."""

    def __init__(
        self, app: Any, *, limits: LimitsConfig, admin_port: int | None = None, **options: Any
    ) -> None:
        super().__init__(
            app,
            http=EdgeProtocol,
            timeout_keep_alive=math.ceil(limits.keepalive_timeout),
            **options,
        )
        self.limits = limits
        self.admin_port = admin_port


class EdgeProtocol(HttpToolsProtocol):
    def __init__(
        self,
        config: uvicorn.Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self._lenient_codings()
        edge = config if isinstance(config, EdgeServerConfig) else None
        self.limits = edge.limits if edge is not None else LimitsConfig()
        self._admin_port = edge.admin_port if edge is not None else None
        self._admin_connections = _ADMIN_CONNECTIONS.setdefault(server_state, _AdminConnections())
        self._on_admin_port = False
        self._deadline: asyncio.TimerHandle | None = None
        # Bytes of the complete fields of the head being parsed: exact, whatever the chunking.
        self._field_bytes = 0
        self._field_count = 0
        # Bytes received for the head being parsed, whole chunks counted: bounds a field still
        # accumulating inside the parser, which no callback reports until it ends.
        self._raw_head_bytes: int | None = None
        self._chunk_size = 0
        # A message ended inside the current chunk, so where the next head began in it is
        # unknown: that chunk's head bytes are counted from the callbacks instead.
        self._message_ended_in_chunk = False
        self._upgrade_offered = False
        self._chunks = ChunkWatch(self.loop, self.limits, self._refuse)
        self._linger: asyncio.TimerHandle | None = None
        # The part of a request that began in a parsed chunk and is still to come.
        self._pending = _Pending.NOTHING
        # After an answer of the server's own nothing more is read from the connection.
        self._done_reading = False
        self._loss = ConnectionLoss()
        # ASGI extensions are dicts; this one holds the connection's loss signal.
        self._extensions: dict[str, dict[object, object]] = {
            DISCONNECT_EXTENSION: {"signal": self._loss}
        }

    # ------------------------------------------------------------------ connection

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if self._admin_port is not None:
            sockname = transport.get_extra_info("sockname")
            self._on_admin_port = sockname is not None and sockname[1] == self._admin_port
        if self._on_admin_port:
            self._admin_connections.open += 1
            held, cap = self._admin_connections.open, self.limits.max_admin_connections
        else:
            held, cap = (
                len(self.connections) - self._admin_connections.open,
                self.limits.max_connections,
            )
        if held > cap:
            listener = "admin" if self._on_admin_port else "proxy"
            self._refuse(
                TooManyConnections(
                    f"this gateway process already holds {cap} {listener} connections; "
                    "try again shortly"
                )
            )
            return
        self._start_deadline(self.limits.request_head_timeout, self._head_timed_out)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_deadline()
        self._chunks.cancel()
        if self._linger is not None:
            self._linger.cancel()
        if self._on_admin_port:
            self._admin_connections.open -= 1
        super().connection_lost(exc)
        self._loss.connection_lost()

    def data_received(self, data: bytes) -> None:
        if self._done_reading:
            return  # a refused client's bytes, read only so that closing sends no reset
        self._unset_keepalive_if_required()
        self._chunk_size = len(data)
        self._message_ended_in_chunk = False
        if self._raw_head_bytes is not None:
            self._raw_head_bytes += len(data)
        mark = self._chunks.mark()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade as upgrade:
            self._reread_without_upgrade(data[upgrade.args[0] :])
            return
        except httptools.HttpParserError as exc:
            refusal = exc.__context__
            if not isinstance(refusal, GatewayError):
                refusal = MalformedRequest(f"the request is not valid HTTP/1.1 ({exc})")
            self._refuse(refusal)
            return
        if self._raw_head_bytes is not None and self._raw_head_bytes > self.limits.max_request_head:
            self._refuse(self._head_too_large())
            return
        self._chunks.after_read(mark, len(data))
        if self._done_reading:
            return
        self._start_pending_deadline()

    # ------------------------------------------------------------ parser callbacks

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.scope["extensions"] = self._extensions
        self._field_bytes = 0
        self._field_count = 0
        self._raw_head_bytes = 0 if self._message_ended_in_chunk else self._chunk_size
        self._pending = _Pending.HEAD

    # ``on_url`` and ``on_header`` do what uvicorn's do themselves, not through ``super()``:
    # the parser calls them for every piece of every head.
    def on_url(self, url: bytes) -> None:
        self.url += url
        self._count_head_bytes(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        self._field_count += 1
        if self._field_count > self.limits.max_header_fields:
            raise RequestHeadTooLarge(
                f"the request has more than {self.limits.max_header_fields} header fields"
            )
        self._count_head_bytes(len(name) + len(value) + _FIELD_OVERHEAD)
        if self._pending is _Pending.BODY:
            # A trailer field (RFC 9110 section 6.5): never one of the request's header
            # fields, which every layer has read (or will read) as the request's own.
            return
        name = name.lower()
        if name == b"expect" and value.lower() == b"100-continue":
            self.expect_100_continue = True
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self._pending = _Pending.NOTHING
        self._cancel_deadline()
        check_request_head(self.parser.get_http_version(), self.headers)
        if self.parser.should_upgrade() and self.parser.get_method() == b"CONNECT":
            raise TunnelRefused("the gateway forwards requests; it does not open tunnels")
        absolute = absolute_form(self.parser.get_method(), self.url)
        if absolute is not None:
            authority, self.url = absolute
            # RFC 9112 section 3.2.2: the target's authority is the request's, not Host's.
            self.headers[:] = [
                (name, authority if name == b"host" else value) for name, value in self.headers
            ]
        self._raw_head_bytes = None
        if self.parser.should_upgrade():
            # The parser skips the body of an upgrade request: the app starts once the head
            # is re-read without the offer (see _reread_without_upgrade).
            self._upgrade_offered = True
            return
        super().on_headers_complete()
        self._pending = _Pending.BODY
        if self.scope["method"] != "HEAD":
            # A HEAD answer has no body write to carry its head: that one goes out alone.
            # The cycle is named weakly: cycle -> transport -> cycle would be a reference
            # cycle, a dozen objects per request left for the collector instead of freed.
            answered = weakref.ref(self.cycle)
            self.cycle.transport = HeadWithBody(  # type: ignore[assignment]
                self.transport, self.loop, close=functools.partial(self._close_answered, answered)
            )

    def on_body(self, body: bytes) -> None:
        if self._chunks.awaiting:
            self._chunks.arrived()
        super().on_body(body)

    def on_chunk_header(self) -> None:
        self._chunks.size_line()

    def on_message_complete(self) -> None:
        self._message_ended_in_chunk = True
        if self._upgrade_offered:
            return
        if self._chunks.awaiting:
            self._chunks.arrived()
        self._pending = _Pending.NOTHING
        self._cancel_deadline()
        super().on_message_complete()

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: ASGI3Application) -> None:
        if cycle.scope["http_version"] == "1.0":
            app = close_delimited(app, cycle)
        super()._start_asgi_task(cycle, app)

    # ------------------------------------------------------------------- limits

    def _count_head_bytes(self, size: int) -> None:
        self._field_bytes += size
        if self._message_ended_in_chunk and self._raw_head_bytes is not None:
            self._raw_head_bytes += size
        if self._field_bytes > self.limits.max_request_head:
            raise self._head_too_large()

    def _head_too_large(self) -> RequestHeadTooLarge:
        return RequestHeadTooLarge(
            f"the request head is larger than {self.limits.max_request_head} bytes"
        )

    def _reread_without_upgrade(self, rest: bytes) -> None:
        head = head_without_upgrade(
            self.parser.get_method(), self.url, self.parser.get_http_version(), self.headers
        )
        self._upgrade_offered = False
        self.parser = httptools.HttpRequestParser(self)
        self._lenient_codings()
        self.data_received(head + rest)

    def _lenient_codings(self) -> None:
        """Let every ``Transfer-Encoding`` reach ``check_request_head``, which answers a
        coding other than chunked with a 501 (llhttp would refuse ``chunked, gzip`` as a bare
        parse error), and keep uvicorn's answer to a request pipelined after a close."""
        self.parser.set_dangerous_leniencies(
            lenient_data_after_close=True, lenient_transfer_encoding=True
        )

    def _start_pending_deadline(self) -> None:
        """Start the deadline of the part still to come once a chunk is parsed: a head or a
        body that arrives whole in one chunk (most do) then costs no timer at all."""
        if self._deadline is not None or self._done_reading:
            return
        if self._pending is _Pending.HEAD:
            self._start_deadline(self.limits.request_head_timeout, self._head_timed_out)
        elif self._pending is _Pending.BODY:
            self._start_deadline(self.limits.request_body_timeout, self._body_timed_out)

    def _start_deadline(self, seconds: float, on_expiry: Any) -> None:
        self._cancel_deadline()
        self._deadline = self.loop.call_later(seconds, on_expiry)

    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _head_timed_out(self) -> None:
        self._deadline = None
        self._refuse(
            RequestTimeout(
                f"the request head did not arrive within {self.limits.request_head_timeout:g}s"
            )
        )

    def _body_timed_out(self) -> None:
        self._deadline = None
        self._refuse(
            RequestTimeout(
                f"the request body did not arrive within {self.limits.request_body_timeout:g}s"
            )
        )

    def _answer_would_be_understood(self) -> bool:
        """Whether the client would read an answer written now as the answer to the request
        being refused: never in the middle of, or ahead of, the app's answer to another."""
        cycle = self.cycle
        if cycle is None:
            return True
        if self._raw_head_bytes is not None:
            # A new head: ``cycle`` is the previous request, whose answer must be whole.
            return cycle.response_complete
        # A body: ``cycle`` is this request, which must not have been answered yet.
        return not cycle.response_started

    def _refuse(self, error: GatewayError) -> None:
        """Answer with ``error`` where the client can tell what it answers, and close."""
        self.logger.info("closing a connection: %s", error.detail)
        self._stop_reading()
        if self.transport.is_closing():
            return
        if self._answer_would_be_understood():
            self.transport.write(closing_problem(error))
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            # As for a client that went away: an app still waiting for the body gets a
            # disconnect (nothing executes), and nothing it sends is written any more.
            cycle.disconnected = True
            cycle.message_event.set()
        self._close_lingering()

    def _stop_reading(self) -> None:
        """What the client sends from now on is dropped, never parsed or timed."""
        self._done_reading = True
        self._cancel_deadline()
        self._chunks.cancel()

    def _close_answered(self, answered: weakref.ref[RequestResponseCycle]) -> None:
        """The app's answer ends the connection (``Connection: close``). Its request's body
        may still be coming (an answer given by the head, such as a missing key): then the
        server lingers as a refusal does, since closing with unread data would reset the
        connection and could destroy the answer before the client reads it."""
        cycle = answered()  # alive: it is the cycle whose answer is closing
        if cycle is None or not cycle.more_body or self.transport.is_closing():
            self.transport.close()
            return
        self._stop_reading()
        self._close_lingering()

    def _close_lingering(self) -> None:
        """Shut the write side once the answer is out, and read (and drop) what the client
        still sends until it ends (``eof_received`` then closes) or the linger runs out."""
        cycle = self.cycle
        answering = cycle is not None and cycle.response_started and not cycle.response_complete
        if answering or not self.transport.can_write_eof():
            # An answer under way may still flush its held head (joined_writes): no write may
            # follow a shut write side, so this connection closes as before.
            self.transport.close()
            return
        self.transport.write_eof()
        # uvicorn pauses reading while an app lags behind the body: the rest must drain.
        self.transport.resume_reading()
        self._linger = self.loop.call_later(LINGER_SECONDS, self.transport.close)
