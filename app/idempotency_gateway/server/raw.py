"""Answers the server layer writes itself, as raw HTTP/1.1 bytes, before any app runs."""

from __future__ import annotations

from http import HTTPStatus

from idempotency_gateway.asgi import Headers
from idempotency_gateway.errors import GatewayError
from idempotency_gateway.problems import problem_body, problem_headers


def closing_problem(error: GatewayError) -> bytes:
    """A whole RFC 9457 problem response that also says the connection ends with it."""
    body = problem_body(error, request_id=None)
    status_line = f"HTTP/1.1 {error.status} {HTTPStatus(error.status).phrase}\r\n".encode()
    fields = [*problem_headers(error, body), (b"connection", b"close")]
    return (
        status_line
        + b"".join(name + b": " + value + b"\r\n" for name, value in fields)
        + (b"\r\n" + body)
    )


def head_without_upgrade(method: bytes, target: bytes, version: str, headers: Headers) -> bytes:
    """The request head again, minus its upgrade offer and with ``Connection: close``.

    Re-read by a fresh parser, the body is then framed by Content-Length or chunked coding as
    for any request; and since the client may believe the connection switched protocols,
    nothing it sends after this request is ever read as HTTP (the parser drops all data after
    a ``close`` message)."""
    lines = [method + b" " + target + b" HTTP/" + version.encode()]
    for name, value in headers:
        if name == b"upgrade":
            continue
        if name == b"connection":
            tokens = [token.strip() for token in value.split(b",")]
            value = b", ".join(token for token in tokens if token.lower() not in (b"upgrade", b""))
            if not value:
                continue
        lines.append(name + b": " + value)
    lines.append(b"connection: close")
    return b"\r\n".join(lines) + b"\r\n\r\n"
