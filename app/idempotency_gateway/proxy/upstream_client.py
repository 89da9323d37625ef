"""The upstream HTTP client: HTTP/1.1 over a pool of keep-alive connections per upstream.

The request goes out byte for byte as the proxy built it: the method, the canonical target
and the fields, with only ``Host`` (the upstream's authority) and ``Content-Length`` added;
no ``User-Agent``, ``Accept`` or ``Content-Type`` of the client's own, no decompression, no
cookies, no redirects, and never a second copy of a request behind the caller's back. httptools
parses the answers (``proxy/connection.py``); the pool is ``proxy/pool.py``. Failures are
sorted by the one thing that matters, whether the request left: ``UpstreamNotSent`` (connect
refused or timed out, a field refused), else ``UpstreamTimeout`` or ``UpstreamConnectionLost``.
"""

from __future__ import annotations

import base64
import ssl
import warnings
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

from idempotency_gateway.asgi import Headers, first_header
from idempotency_gateway.config import UpstreamConfig
from idempotency_gateway.errors import (
    LeaseNotConfirmed,
    UpstreamInvalidResponse,
    UpstreamNotSent,
    UpstreamRequestRefused,
    is_final_status,
)
from idempotency_gateway.execution import Execution
from idempotency_gateway.proxy.connection import UpstreamConnection
from idempotency_gateway.proxy.pool import ConnectionPool

# Methods without a body by definition: as HTTP clients commonly do, every other method without a
# body says so with ``Content-Length: 0`` (some servers answer 411 to a POST without it).
_BODYLESS_METHODS = frozenset({b"GET", b"HEAD", b"OPTIONS", b"TRACE"})


@dataclass(frozen=True, slots=True)
class UpstreamRequest:
    method: str
    target: bytes
    """The request line's target: the base URL's path, the canonical path and the query."""
    headers: Headers
    """Sent as they are, in order; never ``Host`` nor ``Content-Length`` (the client writes
    those)."""
    body: bytes


class UpstreamResponse:
    """The final answer's head; the body follows through ``chunks()``. ``release()`` it once:
    the connection goes back to the pool only if the whole answer was received."""

    __slots__ = ("_connection", "_pool", "_silence", "headers", "status")

    def __init__(
        self, connection: UpstreamConnection, pool: ConnectionPool, silence: float
    ) -> None:
        self._connection: UpstreamConnection | None = connection
        self._pool = pool
        self._silence = silence
        self.status = connection.status
        self.headers: Headers = connection.headers
        """Lower-cased names, values as received."""

    def header(self, name: str) -> str | None:
        value = first_header(self.headers, name.lower().encode("latin-1"))
        return None if value is None else value.decode("latin-1")

    @property
    def buffered(self) -> int:
        """Body bytes received and not yet read: reading the socket pauses above
        ``READ_BUFFER_HIGH``, so this stays under it plus one read."""
        connection = self._connection
        return 0 if connection is None else connection.buffered

    def release(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            self._pool.release(connection, reusable=connection.complete and connection.keep_alive)

    def __del__(self, _warnings: Any = warnings) -> None:
        # A response dropped unreleased is a bug: it must not hold its connection's place in
        # the pool for good (the cap would shrink by one each time), and it is reported with a
        # ResourceWarning. ``warnings`` is bound as a default: at interpreter exit the
        # module global may already be gone.
        if self._connection is not None:
            self.release()
            _warnings.warn(f"unreleased upstream response {self!r}", ResourceWarning, source=self)

    async def chunks(self) -> AsyncIterator[tuple[bytes, bool]]:
        """The body as it arrives, each chunk with whether it is the last (the whole body
        was received and nothing is left to read); ``timeouts.per_try`` bounds every silence;
        a broken stream raises an ``UpstreamError``. A body that came with the head is one
        chunk, without a wait; larger ones go on in the pieces they arrived in."""
        while (connection := self._connection) is not None:
            if connection.has_body:
                yield connection.take(), connection.complete and not connection.has_body
            elif connection.complete:
                return
            else:
                await connection.more(self._silence)


class UpstreamClient:
    def __init__(self, name: str, config: UpstreamConfig) -> None:
        self.name = name
        self.config = config
        base = urlsplit(config.base_url)
        self._host = base.hostname or ""
        self._port = base.port or (443 if base.scheme == "https" else 80)
        self._tls = base.scheme == "https"
        self.base_path = base.path.rstrip("/").encode("ascii")
        """Joined in front of every canonical path (``proxy/app.py``)."""
        authority = base.netloc.rpartition("@")[2]
        self._host_line = b" HTTP/1.1\r\nHost: " + authority.encode("ascii")
        # Credentials in the base URL become Basic authentication, in place of the client's
        # own Authorization, as HTTP clients commonly send them.
        self._authorization: bytes | None = None
        if base.username is not None:
            credentials = f"{unquote(base.username)}:{unquote(base.password or '')}"
            self._authorization = b"Basic " + base64.b64encode(credentials.encode("latin-1"))
        self._pool: ConnectionPool | None = None

    async def start(self) -> None:
        self._pool = ConnectionPool(
            self.name,
            host=self._host,
            port=self._port,
            ssl_context=self.config.tls.context() if self._tls else None,
            server_name=self.config.tls.server_name,
            max_connections=self.config.pool.max_connections,
            keepalive=self.config.pool.keepalive,
        )

    @property
    def pool(self) -> ConnectionPool:
        assert self._pool is not None, "UpstreamClient.start() was not called"
        return self._pool

    async def close(self) -> None:
        if self._pool is not None:
            self._pool.close()

    async def open(
        self,
        request: UpstreamRequest,
        *,
        head_within: float,
        execution: Execution | None = None,
    ) -> UpstreamResponse:
        """One attempt: ``head_within`` seconds bound the wait for the response head (and
        connecting, within ``timeouts.connect``). The caller must ``release()`` the response.

        For a keyed ``execution`` the attempt leaves only while its owner holds the lease:
        confirmed before a connection is taken (a round trip only when the lease is not
        trusted any more) and checked again, without I/O, right before the write; else
        ``LeaseNotConfirmed`` and nothing was written."""
        pool = self._pool
        assert pool is not None, "UpstreamClient.start() was not called"
        data = self._encode(request)
        if execution is not None:
            await execution.confirm()
        started = pool.loop.time()
        connection = pool.idle_connection(started)
        if connection is None:
            connect_within = min(self.config.timeouts.connect, head_within)
            connection = await self._connect(pool, started + connect_within)
        if execution is not None:
            try:
                execution.check()
            except LeaseNotConfirmed:
                pool.release(connection, reusable=True)  # nothing was written on it
                raise
        try:
            connection.send(
                data, head_deadline=started + head_within, head_only=request.method == "HEAD"
            )
            await connection.head()
        except BaseException:
            # Failed, timed out or cancelled (the client went away): never reused half-way.
            pool.release(connection, reusable=False)
            raise
        if not is_final_status(connection.status):
            pool.release(connection, reusable=False)
            raise UpstreamInvalidResponse(
                f"upstream {self.name!r} answered with status {connection.status}, which is "
                "not a final HTTP status; the request may or may not have been processed"
            )
        return UpstreamResponse(connection, pool, self.config.timeouts.per_try)

    async def _connect(self, pool: ConnectionPool, deadline: float) -> UpstreamConnection:
        try:
            return await pool.connect(deadline)
        except TimeoutError:
            raise UpstreamNotSent(f"connecting to upstream {self.name!r} timed out") from None
        except ssl.SSLError as exc:
            # Before the request: a certificate that does not verify (expired, another host's,
            # an unknown CA) or an upstream that refused the handshake.
            why = exc.reason or str(exc)
            if verified := getattr(exc, "verify_message", None):
                why = f"{why}: {verified}"
            raise UpstreamNotSent(
                f"the TLS handshake with upstream {self.name!r} failed ({why}); nothing was sent"
            ) from exc
        except OSError as exc:
            raise UpstreamNotSent(f"cannot connect to upstream {self.name!r}: {exc}") from exc

    def _encode(self, request: UpstreamRequest) -> bytes:
        """Head and body as one buffer, for one write. A CR, LF or NUL anywhere in the head
        but in the line breaks written here is refused: it would let a field or a second
        request past the upstream's framing."""
        method = request.method.encode("latin-1")
        lines = [method, b" ", request.target, self._host_line]
        headers = request.headers
        if self._authorization is not None:
            headers = [(n, v) for n, v in headers if n.lower() != b"authorization"]
            headers.append((b"authorization", self._authorization))
        for name, value in headers:
            lines += (b"\r\n", name, b": ", value)
        # The line breaks written here: after the request line, Host, each field and the
        # length, and the empty line (two).
        breaks = len(headers) + 3
        body = request.body
        if body:
            lines.append(b"\r\nContent-Length: %d" % len(body))
            breaks += 1
        elif method not in _BODYLESS_METHODS:
            lines.append(b"\r\nContent-Length: 0")
            breaks += 1
        lines.append(b"\r\n\r\n")
        head = b"".join(lines)
        # One pass: deleting CR, LF and NUL removes exactly our breaks' two bytes each.
        if len(head) - len(head.translate(None, b"\r\n\x00")) != 2 * breaks:
            raise UpstreamRequestRefused(
                f"a field for upstream {self.name!r} holds CR, LF or NUL; nothing was sent"
            )
        return head + body if body else head
