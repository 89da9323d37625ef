"""What every minimal proxy baseline does the same way, whatever its server or client.

Shared so that the baselines differ only in the piece each one measures (the ASGI server or
the upstream client), never in how they read the request or which headers they drop.
"""

from __future__ import annotations

from typing import Any

# Hop-by-hop headers (RFC 9110 section 7.6.1) plus Host, which the client sets for upstream.
HOP = {b"connection", b"keep-alive", b"transfer-encoding", b"te", b"upgrade", b"host", b"trailer"}


async def read_body(receive: Any) -> bytes:
    body, more = b"", True
    while more:
        message = await receive()
        body, more = body + message.get("body", b""), message.get("more_body", False)
    return body


def forwarded_headers(scope: dict[str, Any]) -> list[tuple[str, str]]:
    """The request's headers for upstream, minus the hop-by-hop ones, as str for the clients."""
    return [(k.decode(), v.decode("latin-1")) for k, v in scope["headers"] if k not in HOP]


def upstream_target(scope: dict[str, Any]) -> str:
    """The request target exactly as the client sent it (raw path, no re-encoding)."""
    target: bytes = scope["raw_path"] + (
        b"?" + scope["query_string"] if scope["query_string"] else b""
    )
    return target.decode("latin-1")
