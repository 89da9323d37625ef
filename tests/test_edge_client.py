"""The edge as a hostile client meets it: trailers, transfer codings, ``Host``, HTTP/1.0
answers cut short, the admin listener's own budget and the 401 challenge.

A real ``idempotency-gateway serve`` process and raw sockets: an ordinary client would never
put a key in a trailer, send ``gzip, chunked``, or a ``Host`` with a six-digit port. Every
refusal by the head is read whole while the client is still sending (the server lingers
instead of resetting the connection under its answer).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import struct
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import pytest
import pytest_asyncio

from tests.support import GatewayProcess, RecordingUpstream
from tests.support.charges import CHARGES
from tests.support.edge import (
    READ_BOUND,
    assert_closing_problem,
    edge_gateway,
    exchange,
    new_key,
    parse_reply,
    request,
)
from tests.support.raw_upstream import RawUpstream, Received

# One gateway serves the tests that need no settings of their own: a process start is the
# slow part of every test here.
pytestmark = pytest.mark.asyncio(loop_scope="module")
LIMITS = {"max_request_head": "4KiB", "request_head_timeout": "1s", "request_body_timeout": "60s"}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def upstream() -> AsyncIterator[RecordingUpstream]:
    async with RecordingUpstream() as recording:
        yield recording


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def gateway(
    tmp_path_factory: pytest.TempPathFactory, postgres_url: str, upstream: RecordingUpstream
) -> AsyncIterator[GatewayProcess]:
    directory = tmp_path_factory.mktemp("edge-client")
    async with edge_gateway(directory, postgres_url, upstream.url, limits=LIMITS) as process:
        yield process


def chunked_head(path: str, fields: Sequence[tuple[str, str]] = ()) -> bytes:
    lines = [
        f"POST {path} HTTP/1.1",
        "Host: edge.test",
        "Connection: close",
        "Transfer-Encoding: chunked",
        *(f"{name}: {value}" for name, value in fields),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def chunked_body(body: bytes, trailers: Sequence[tuple[str, str]] = ()) -> bytes:
    fields = "".join(f"{name}: {value}\r\n" for name, value in trailers).encode("latin-1")
    return b"%x\r\n%s\r\n0\r\n%s\r\n" % (len(body), body, fields)


def detail_of(raw: bytes) -> str:
    detail = json.loads(parse_reply(raw).body)["detail"]
    assert isinstance(detail, str)
    return detail


# ---------------------------------------------------------------------------- trailers


@pytest.mark.parametrize("split", [False, True], ids=["one-write", "head-then-body"])
async def test_trailer_fields_never_count_as_header_fields(
    gateway: GatewayProcess, upstream: RecordingUpstream, split: bool
) -> None:
    key, trailer_key = new_key(), new_key()
    unkeyed_head = chunked_head(CHARGES)
    unkeyed_body = chunked_body(b"{}", [("Idempotency-Key", trailer_key)])
    keyed_head = chunked_head(CHARGES, [("Idempotency-Key", key)])
    keyed_body = chunked_body(
        b"{}", [("Idempotency-Key", trailer_key), ("X-Trailer-Only", "smuggled")]
    )

    def writes(head: bytes, body: bytes) -> tuple[bytes, ...]:
        return (head, body) if split else (head + body,)

    # A key sent only in a trailer does not satisfy `key: required`.
    unkeyed = parse_reply(await exchange(gateway.port, *writes(unkeyed_head, unkeyed_body)))
    keyed = parse_reply(await exchange(gateway.port, *writes(keyed_head, keyed_body)))

    assert (unkeyed.status, unkeyed.problem_slug) == (400, "idempotency-key-missing")
    assert keyed.status == 201
    assert upstream.count(trailer_key) == 0
    [execution] = upstream.executions_for(key)
    assert execution.header_values("Idempotency-Key") == [key]
    assert execution.header_values("X-Trailer-Only") == []
    assert execution.body == b"{}"


async def test_a_trailer_section_that_never_ends_is_bounded_in_size_and_time(
    gateway: GatewayProcess, upstream: RecordingUpstream
) -> None:
    key = new_key()
    head = chunked_head(CHARGES, [("Idempotency-Key", key)])
    endless_field = head + b"2\r\n{}\r\n0\r\nX-Endless: "
    # Far more than one read of the socket holds: most of it arrives as reads of a trailer
    # field that never ends.
    padding = [b"a" * 8192] * 128
    many_fields = [head + b"2\r\n{}\r\n0\r\n", *([b"X-Trailer: " + b"b" * 100 + b"\r\n"] * 60)]

    oversized = await exchange(gateway.port, endless_field, *padding)
    too_many = await exchange(gateway.port, *many_fields)
    # Sent at once, then nothing: only the clock ends it (the body's own deadline is a
    # minute away).
    stalled = await exchange(gateway.port, endless_field + b"a" * 100)
    nothing_ran = upstream.count(key)
    retried = parse_reply(
        await exchange(gateway.port, head + chunked_body(b"{}", [("X-Fine", "1")]))
    )

    assert_closing_problem(parse_reply(oversized), 431, "request-head-too-large")
    assert_closing_problem(parse_reply(too_many), 431, "request-head-too-large")
    assert_closing_problem(parse_reply(stalled), 408, "request-timeout")
    assert "trailer section" in detail_of(stalled)
    assert nothing_ran == 0
    # The key stayed unused: the whole request runs once.
    assert retried.status == 201
    assert upstream.count(key) == 1


# --------------------------------------------------------------------- transfer codings

CODINGS = [
    ("gzip, chunked", 501, "transfer-coding-not-implemented"),
    ("chunked, gzip", 501, "transfer-coding-not-implemented"),
    ("gzip", 501, "transfer-coding-not-implemented"),
    ("identity", 501, "transfer-coding-not-implemented"),
    ("deflate\r\nTransfer-Encoding: chunked", 501, "transfer-coding-not-implemented"),
    ("chunked\r\nTransfer-Encoding: chunked", 400, "malformed-request"),
    ("chunked, chunked", 400, "malformed-request"),
    ("chunked,", 400, "malformed-request"),
]


async def test_a_transfer_coding_other_than_a_lone_chunked_is_refused(
    gateway: GatewayProcess, upstream: RecordingUpstream
) -> None:
    key = new_key()

    def head(coding: str) -> bytes:
        return chunked_head(CHARGES, [("Idempotency-Key", key)]).replace(
            b"Transfer-Encoding: chunked", b"Transfer-Encoding: " + coding.encode()
        )

    # A large body still on its way when the head is refused: the answer must survive it.
    body = [b"2000\r\n" + b"z" * 0x2000 + b"\r\n"] * 64 + [b"0\r\n\r\n"]
    refused = [parse_reply(await exchange(gateway.port, head(c), *body)) for c, _, _ in CODINGS]
    nothing_ran = upstream.count(key)
    # The one coding read here, in any case: the same key then runs once.
    answered = parse_reply(await exchange(gateway.port, head("Chunked") + chunked_body(b"{}")))

    for reply, (_, status, slug) in zip(refused, CODINGS, strict=True):
        assert_closing_problem(reply, status, slug)
    assert nothing_ran == 0
    assert answered.status == 201
    assert upstream.count(key) == 1


async def test_an_http10_request_with_a_transfer_coding_is_refused(
    gateway: GatewayProcess, upstream: RecordingUpstream
) -> None:
    # HTTP/1.0 has no transfer codings (RFC 9112 section 6.1): an HTTP/1.0 intermediary in
    # front reads no body here, and the chunk data, a whole keyed request, as its next one.
    key, smuggled_key = new_key(), new_key()
    smuggled = request("POST", CHARGES, [("Idempotency-Key", smuggled_key)], b"{}")
    head = chunked_head(CHARGES, [("Idempotency-Key", key)]).replace(b"HTTP/1.1", b"HTTP/1.0")

    reply = parse_reply(await exchange(gateway.port, head + chunked_body(smuggled)))

    assert_closing_problem(reply, 400, "malformed-request")
    assert "HTTP/1.0" in json.loads(reply.body)["detail"]
    assert upstream.count(key) == upstream.count(smuggled_key) == 0


# -------------------------------------------------------------------------------- Host

NOT_AN_AUTHORITY = [
    b"edge.test:999999",
    b"edge.test:65536",
    b"edge.test:80:80",
    b"edge .test",
    b"edge.test%0d%0aX-Injected:%20yes",
    b"edge.test,evil.test",
    b"user@edge.test",
    b"[::1",
    b":8080",
    b"e" * 300,
]
NOT_AN_HTTP_URI = [
    b"ftp://real.test/v1/where",
    b"ws://real.test/v1/where",
    b"http://user:pass@real.test/v1/where",
    b"http://real.test:99999/v1/where",
    b"http:///v1/where",
    b"http://real .test/v1/where",
]
# (target, Host, the path and the X-Forwarded-Host the upstream gets)
AUTHORITIES = [
    (b"/v1/where", b"edge.test:65535", "/v1/where", ["edge.test:65535"]),
    (b"/v1/where", b"[::1]:8080", "/v1/where", ["[::1]:8080"]),
    (b"/v1/where", b"", "/v1/where", []),
    (b"http://real.test:8443/v1/where?x=1", b"edge.test", "/v1/where", ["real.test:8443"]),
    (b"HTTPS://Real.test/v1/where", b"edge.test", "/v1/where", ["Real.test"]),
    # An empty path is / (RFC 9112 section 3.2.2).
    (b"http://real.test?where=1", b"edge.test", "/", ["real.test"]),
]


def get(target: bytes, host: bytes, test_id: str, method: bytes = b"GET") -> bytes:
    fields = b"Host: " + host + b"\r\nX-Test-Id: " + test_id.encode() + b"\r\nConnection: close"
    return method + b" " + target + b" HTTP/1.1\r\n" + fields + b"\r\n\r\n"


async def test_host_and_absolute_targets_must_name_an_http_authority(
    gateway: GatewayProcess, upstream: RecordingUpstream
) -> None:
    test_id = new_key()
    bad_hosts = [
        parse_reply(await exchange(gateway.port, get(b"/v1/where", host, test_id)))
        for host in NOT_AN_AUTHORITY
    ]
    bad_targets = [
        parse_reply(await exchange(gateway.port, get(target, b"edge.test", test_id)))
        for target in NOT_AN_HTTP_URI
    ]
    # With no path, OPTIONS names the server itself (RFC 9112 section 3.2.4), as OPTIONS *.
    server_wide = get(b"http://real.test", b"edge.test", test_id, method=b"OPTIONS")
    bad_targets.append(parse_reply(await exchange(gateway.port, server_wide)))
    nothing_ran = upstream.executions_of_test_id(test_id)
    answers = [
        parse_reply(await exchange(gateway.port, get(target, host, test_id)))
        for target, host, _, _ in AUTHORITIES
    ]

    for reply in bad_hosts + bad_targets:
        assert_closing_problem(reply, 400, "malformed-request")
    assert nothing_ran == []
    assert [reply.status for reply in answers] == [201] * len(AUTHORITIES)
    executions = upstream.executions_of_test_id(test_id)
    assert [execution.path for execution in executions] == [path for _, _, path, _ in AUTHORITIES]
    # The target's authority, when it has one, is the request's (RFC 9112 section 3.2.2).
    assert [e.header_values("X-Forwarded-Host") for e in executions] == [
        forwarded for _, _, _, forwarded in AUTHORITIES
    ]


# ------------------------------------------------------------------- query fingerprints

# Pairs an upstream may read as two requests: fields split at ";" too (so the values of "a"
# come in another order), and a malformed escape kept as is versus an encoded "%".
DISTINCT_QUERIES = [("x=1;a=2&a=3", "a=3&x=1;a=2"), ("q=%GG", "q=%25GG")]


async def test_queries_an_upstream_can_tell_apart_never_share_a_key(
    gateway: GatewayProcess, upstream: RecordingUpstream
) -> None:
    keys = [new_key() for _ in DISTINCT_QUERIES]
    first, second, again = [], [], []
    for key, (query, other) in zip(keys, DISTINCT_QUERIES, strict=True):
        fields = [("Idempotency-Key", key), ("Connection", "close")]
        first.append(
            parse_reply(
                await exchange(gateway.port, request("POST", f"{CHARGES}?{query}", fields, b"{}"))
            )
        )
        second.append(
            parse_reply(
                await exchange(gateway.port, request("POST", f"{CHARGES}?{other}", fields, b"{}"))
            )
        )
        again.append(
            parse_reply(
                await exchange(gateway.port, request("POST", f"{CHARGES}?{query}", fields, b"{}"))
            )
        )

    assert [reply.status for reply in first] == [201] * len(keys)
    # Not a replay of the first request's answer: the key was reused for another request.
    assert [(reply.status, reply.problem_slug) for reply in second] == [
        (422, "idempotency-key-reused")
    ] * len(keys)
    # The same bytes again are the same request: replayed.
    assert [reply.headers.get("idempotent-replayed") for reply in again] == ["true"] * len(keys)
    assert [upstream.count(key) for key in keys] == [1] * len(keys)


# ------------------------------------------------------------------ HTTP/1.0, cut short


def _reset(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


async def _whole_or_cut(
    request: Received, _: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    """An answer without a length: whole then closed, or (for ``/cut``) half, then reset."""
    cut = request.head.startswith(b"GET /cut ")
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\n")
    writer.write(b"the first half" if cut else b"the whole answer")
    await writer.drain()
    if cut:
        _reset(writer)
    else:
        writer.close()


async def read_to_the_end(port: int, raw: bytes) -> tuple[bytes, bool]:
    """What the gateway sent, and whether the connection ended with a reset."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    received = b""
    try:
        writer.write(raw)
        while chunk := await asyncio.wait_for(reader.read(65536), READ_BOUND):
            received += chunk
    except ConnectionResetError:
        return received, True
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    return received, False


async def test_an_http10_answer_cut_short_ends_with_a_reset_not_a_close(
    tmp_path: Path, postgres_url: str
) -> None:
    async with (
        RawUpstream(_whole_or_cut) as raw_upstream,
        edge_gateway(tmp_path, postgres_url, raw_upstream.url) as cutting,
    ):
        _, cut_reset = await read_to_the_end(cutting.port, b"GET /cut HTTP/1.0\r\n\r\n")
        complete, complete_reset = await read_to_the_end(
            cutting.port, b"GET /whole HTTP/1.0\r\n\r\n"
        )

    # The client can tell: a reset, never the orderly close that ends a complete answer.
    assert cut_reset
    assert not complete_reset
    reply = parse_reply(complete)
    assert (reply.status, reply.body) == (200, b"the whole answer")
    assert "transfer-encoding" not in reply.headers


# --------------------------------------------------------------------- the admin listener


async def test_the_admin_listener_has_its_own_connection_budget_and_401s_challenge(
    tmp_path: Path, postgres_url: str, upstream: RecordingUpstream
) -> None:
    limits = {"max_connections": 5, "max_admin_connections": 3, "request_head_timeout": "60s"}
    healthz = b"GET /healthz HTTP/1.1\r\nHost: edge.test\r\nConnection: close\r\n\r\n"
    key = new_key()
    anonymous = request("POST", CHARGES, [("Idempotency-Key", key), ("Connection", "close")], b"{}")
    async with (
        edge_gateway(
            tmp_path, postgres_url, upstream.url, anonymous="refuse", limits=limits
        ) as refusing,
        contextlib.AsyncExitStack() as held,
    ):
        credential_required = parse_reply(await exchange(refusing.port, anonymous))

        async def hold(port: int, count: int) -> None:
            for _ in range(count):
                _, writer = await asyncio.open_connection("127.0.0.1", port)
                held.callback(writer.close)

        await hold(refusing.port, 5)
        # The probes send nothing: request bytes arriving after the gateway closed would
        # make the kernel reset the connection under the answer.
        proxy_full = parse_reply(await exchange(refusing.port))
        alive = parse_reply(await exchange(refusing.admin_port, healthz))
        await hold(refusing.admin_port, 3)
        admin_full = parse_reply(await exchange(refusing.admin_port))

    # The proxy's own 401 says how to authenticate too (RFC 9110 section 11.6.1).
    assert (credential_required.status, credential_required.problem_slug) == (
        401,
        "credential-required",
    )
    assert credential_required.headers["www-authenticate"] == "Bearer"
    assert upstream.count(key) == 0
    assert_closing_problem(proxy_full, 503, "too-many-connections")
    # A flood of idle proxy connections does not fail the liveness probe.
    assert alive.status == 200
    assert_closing_problem(admin_full, 503, "too-many-connections")
    assert "admin connections" in json.loads(admin_full.body)["detail"]
