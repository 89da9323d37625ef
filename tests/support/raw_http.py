"""HTTP/1.1 over a plain socket, for requests ordinary clients would refuse or normalize away
(CR/LF in fields, dot segments, absolute-form targets, uploads cut short, slow trickles).

    reply = exchange(port, request_bytes(b"POST", b"/v1/charges", headers, body))
    assert_clear_answer(reply).slug()

Synchronous on purpose: hypothesis tests drive a gateway served from a background thread.
"""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tests.support.problems import DOCUMENTED_5XX, PROBLEM_JSON, slug_of

SOCKET_TIMEOUT = 10.0


@dataclass(frozen=True)
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    @property
    def from_upstream(self) -> bool:
        """Relayed from the upstream: the gateway adds ``Via`` to those, never to its own."""
        return "via" in self.headers

    def problem(self) -> dict[str, Any]:
        assert self.headers.get("content-type", "").startswith(PROBLEM_JSON), self
        document = json.loads(self.body)
        assert isinstance(document, dict)
        return document

    def slug(self) -> str:
        return slug_of(str(self.problem()["type"]))


def request_bytes(
    method: bytes,
    target: bytes,
    headers: Sequence[tuple[bytes, bytes]],
    body: bytes = b"",
    *,
    content_length: int | None = None,
) -> bytes:
    """An HTTP/1.1 request exactly as given (no validation: that is the point)."""
    lines = [method + b" " + target + b" HTTP/1.1", b"Host: 127.0.0.1", b"Connection: close"]
    lines += [name + b": " + value for name, value in headers]
    length = len(body) if content_length is None else content_length
    lines.append(b"Content-Length: " + str(length).encode())
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def chunked_request_bytes(
    method: bytes,
    target: bytes,
    headers: Sequence[tuple[bytes, bytes]],
    chunks: Sequence[bytes],
    trailers: Sequence[tuple[bytes, bytes]] = (),
    *,
    codings: Sequence[bytes] = (b"chunked",),
) -> bytes:
    """An HTTP/1.1 request with a chunked body, a ``Transfer-Encoding`` field per coding
    given, and trailer fields after the last chunk, exactly as given."""
    lines = [method + b" " + target + b" HTTP/1.1", b"Host: 127.0.0.1", b"Connection: close"]
    lines += [b"Transfer-Encoding: " + coding for coding in codings]
    lines += [name + b": " + value for name, value in headers]
    body = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for chunk in chunks if chunk)
    trailer = b"".join(name + b": " + value + b"\r\n" for name, value in trailers)
    return b"\r\n".join(lines) + b"\r\n\r\n" + body + b"0\r\n" + trailer + b"\r\n"


def _dechunk(data: bytes) -> bytes:
    body = b""
    while data:
        size_line, _, data = data.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            break
        body, data = body + data[:size], data[size + 2 :]
    return body


def exchange(
    port: int,
    raw: bytes,
    *,
    pieces: int = 1,
    pause: float = 0.0,
    cut_after: int | None = None,
) -> Reply | None:
    """Send ``raw`` (in ``pieces``, ``pause`` seconds apart: a trickle) and read the answer
    until the server closes. ``cut_after``: send only that many bytes, then close our side
    (an upload cut short). ``None`` when the server closed without answering."""
    with socket.create_connection(("127.0.0.1", port), timeout=SOCKET_TIMEOUT) as sock:
        payload = raw if cut_after is None else raw[:cut_after]
        step = max(1, -(-len(payload) // pieces))
        for start in range(0, len(payload), step):
            sock.sendall(payload[start : start + step])
            if pause:
                time.sleep(pause)  # the trickle itself: this client is slow on purpose
        if cut_after is not None:
            sock.shutdown(socket.SHUT_WR)
        received = b""
        with contextlib.suppress(ConnectionResetError):
            while chunk := sock.recv(65536):
                received += chunk
    if not received:
        return None
    head, _, body = received.partition(b"\r\n\r\n")
    while head.split(b" ", 2)[1].startswith(b"1"):  # an interim answer (100 Continue)
        head, _, body = body.partition(b"\r\n\r\n")
    status_line, *header_lines = head.split(b"\r\n")
    headers: dict[str, str] = {}
    for line in header_lines:
        name, _, value = line.partition(b":")
        headers[name.strip().lower().decode("latin-1")] = value.strip().decode("latin-1")
    if headers.get("transfer-encoding") == "chunked":
        body = _dechunk(body)
    elif "content-length" in headers:
        body = body[: int(headers["content-length"])]
    return Reply(int(status_line.split()[1]), headers, body)


def assert_clear_answer(reply: Reply | None) -> Reply:
    """An answer, not a 500; a gateway error is an RFC 9457 problem; a 5xx is documented."""
    assert reply is not None, "the gateway closed the connection without an answer"
    assert reply.status != 500, reply
    if reply.status >= 400 and not reply.from_upstream:
        problem = reply.problem()
        assert {"type", "title", "status", "detail", "retryable"} <= problem.keys(), problem
        assert problem["status"] == reply.status
        slug = slug_of(problem["type"])
        if reply.status >= 500:
            assert DOCUMENTED_5XX.get(slug) == reply.status
    return reply
