"""The upstream sees an idempotency key in one form, whichever form the client wrote it in.

``Idempotency-Key: abc`` and ``Idempotency-Key: "abc"`` (an RFC 8941 sf-string, as the IETF
draft writes it) are one key to the gateway; an upstream that dedupes by the field must see
them as one key too. The gateway forwards the bare key. Requests go over raw sockets so the
field reaches the gateway byte for byte as written here.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import pytest

from tests.support import RecordingUpstream
from tests.support.gateway import GatewayLauncher, RunningGateway, gateway_config, route
from tests.support.upstream import EXECUTION_HEADER

BODY = b'{"amount": 1000}'


@pytest.fixture
async def gateway_and_upstream(
    postgres_url: str,
) -> AsyncIterator[tuple[RunningGateway, RecordingUpstream]]:
    async with RecordingUpstream() as upstream, GatewayLauncher() as launcher:
        config = gateway_config(upstream.url, routes=[route("/", key="required")])
        yield await launcher.start(config, database_url=postgres_url), upstream


async def post_with_raw_key(gateway: RunningGateway, key_field: bytes) -> tuple[int, bytes]:
    """POST with the ``Idempotency-Key`` field value exactly ``key_field``; status and head."""
    host, port = gateway.url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(
            b"POST /v1/charges HTTP/1.1\r\nHost: gateway\r\nConnection: close\r\n"
            b"Authorization: Bearer sk_key_form\r\nContent-Type: application/json\r\n"
            b"Idempotency-Key: " + key_field + b"\r\n"
            b"Content-Length: " + str(len(BODY)).encode() + b"\r\n\r\n" + BODY
        )
        answer = await asyncio.wait_for(reader.read(), timeout=10.0)
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
    head = answer.split(b"\r\n\r\n", 1)[0]
    return int(head.split(b" ", 2)[1]), head.lower()


@pytest.mark.parametrize(
    ("first", "second"),
    [(b'"{key}"', b"{key}"), (b"{key}", b'"{key}"')],
    ids=["quoted-then-bare", "bare-then-quoted"],
)
async def test_both_forms_reach_the_upstream_as_the_bare_key_once(
    gateway_and_upstream: tuple[RunningGateway, RecordingUpstream],
    unique: Callable[[str], str],
    first: bytes,
    second: bytes,
) -> None:
    gateway, upstream = gateway_and_upstream
    key = unique("form")
    status, original = await post_with_raw_key(gateway, first.replace(b"{key}", key.encode()))
    assert status == 201
    status, replay = await post_with_raw_key(gateway, second.replace(b"{key}", key.encode()))
    assert status == 201
    assert b"idempotent-replayed: true" in replay
    (execution,) = upstream.executions_for(key)
    assert execution.header_values("Idempotency-Key") == [key]
    marker = f"{EXECUTION_HEADER.lower()}: {execution.number}\r\n".encode()
    assert marker in original + b"\r\n"
    assert marker in replay + b"\r\n"


async def test_an_escaped_sf_string_is_forwarded_unescaped(
    gateway_and_upstream: tuple[RunningGateway, RecordingUpstream],
    unique: Callable[[str], str],
) -> None:
    gateway, upstream = gateway_and_upstream
    key = unique("esc") + '"q\\'
    quoted = '"' + key.replace("\\", "\\\\").replace('"', '\\"') + '"'
    status, _ = await post_with_raw_key(gateway, quoted.encode())
    assert status == 201
    (execution,) = upstream.executions_for(key)
    assert execution.header_values("Idempotency-Key") == [key]
