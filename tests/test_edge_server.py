"""The HTTP edge under attack: a real ``idempotency-gateway serve`` process, raw sockets.

Ordinary clients would normalize these requests away (they never name their own headers in
``Connection``, never pipeline after an ``Upgrade`` offer, never trickle a head), so every
request here is written byte for byte, and the recording upstream says what got through.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from idempotency_gateway.asgi import Receive, Scope, Send
from idempotency_gateway.config import (
    ConfigError,
    IdempotencyConfig,
    LimitsConfig,
    dump_config,
    load_config,
)
from idempotency_gateway.idempotency import IdempotencyMiddleware
from idempotency_gateway.storage.base import RecordStore
from tests.support import RecordingUpstream, eventually, serve_asgi
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
from tests.support.gateway import gateway_config
from tests.support.servers import TEST_SCOPE_SECRET

pytestmark = pytest.mark.slow

TIGHT_LIMITS = {
    "max_request_head": "4KiB",
    "max_header_fields": 20,
    "request_head_timeout": "1s",
    "request_body_timeout": "1s",
}


@pytest.fixture
async def upstream() -> AsyncIterator[RecordingUpstream]:
    async with RecordingUpstream() as recording:
        yield recording


# ------------------------------------------------------------------ the gateway's own fields


async def test_connection_options_never_strip_the_fields_the_gateway_writes(
    tmp_path: Path, postgres_url: str, upstream: RecordingUpstream
) -> None:
    key = new_key()
    named = (
        "Idempotency-Key, Idempotency-Fencing-Token, X-Request-Id, Via, X-Forwarded-For, "
        "X-Forwarded-Proto, X-Forwarded-Host, X-Request-Timeout, X-Client-Hop"
    )
    fields = [
        ("Connection", named),
        ("Idempotency-Key", key),
        ("Idempotency-Fencing-Token", "0"),
        ("X-Request-Id", "client-chosen-id"),
        ("X-Client-Hop", "for-the-next-hop-only"),
    ]
    async with edge_gateway(tmp_path, postgres_url, upstream.url) as gateway:
        reply = parse_reply(await exchange(gateway.port, request("POST", CHARGES, fields, b"{}")))

    assert reply.status == 201
    [execution] = upstream.executions_for(key)
    assert execution.header_values("Idempotency-Key") == [key]
    # The gateway's token of record, never the client's forgery.
    [token] = execution.header_values("Idempotency-Fencing-Token")
    # Tokens start at 1: a 0 could only be the client's forgery.
    assert int(token) >= 1
    assert execution.header_values("X-Request-Id") == ["client-chosen-id"]
    assert execution.header_values("Via") == ["1.1 idempotency-gateway"]
    assert execution.header_values("X-Forwarded-For") == ["127.0.0.1"]
    assert execution.header_values("X-Forwarded-Proto") == ["http"]
    assert execution.header_values("X-Forwarded-Host") == ["edge.test"]
    assert len(execution.header_values("X-Request-Timeout")) == 1
    # The client's own hop-by-hop fields still stop at the gateway.
    assert execution.header_values("X-Client-Hop") == []
    assert execution.header_values("Connection") == []


# ------------------------------------------------------------------------ upgrade offers

H2C_OFFER = [
    ("Connection", "Upgrade, HTTP2-Settings"),
    ("Upgrade", "h2c"),
    ("HTTP2-Settings", "AAMAAABkAAQCAAAAAAIAAAAA"),
]


@pytest.mark.parametrize("keyed", [True, False], ids=["keyed", "unkeyed"])
@pytest.mark.parametrize("split", [False, True], ids=["one-write", "head-then-body"])
async def test_an_upgrade_offer_keeps_its_body_and_nothing_after_it_is_read(
    tmp_path: Path, postgres_url: str, upstream: RecordingUpstream, keyed: bool, split: bool
) -> None:
    key = new_key()
    path = CHARGES if keyed else f"/v1/unkeyed/{key}"
    body = b'{"amount": 1000, "note": "' + b"x" * 3000 + b'"}'
    fields = [*H2C_OFFER, ("X-Test-Id", key), *([("Idempotency-Key", key)] if keyed else [])]
    head, _, _ = request("POST", path, fields, body).partition(b"\r\n\r\n")
    smuggled = request("POST", "/smuggled", [("X-Test-Id", key)], b"evil")
    writes = (
        (head + b"\r\n\r\n", body + smuggled) if split else (head + b"\r\n\r\n" + body + smuggled,)
    )
    async with edge_gateway(tmp_path, postgres_url, upstream.url) as gateway:
        raw = await exchange(gateway.port, *writes)
        # A request after the exchange: anything smuggled would have reached the upstream first.
        sentinel = parse_reply(
            await exchange(gateway.port, request("GET", "/sentinel", [("Connection", "close")]))
        )

    reply = parse_reply(raw)
    assert reply.status == 201
    assert reply.headers["connection"] == "close"
    assert raw.count(b"HTTP/1.1 ") == 1
    assert sentinel.status == 201
    [execution] = upstream.executions_of_test_id(key)
    assert execution.path == path
    assert execution.body == body
    assert execution.header_values("Upgrade") == []
    assert all(e.path != "/smuggled" for e in upstream.executions)


async def test_tunnels_and_non_http_bytes_are_refused_before_anything_is_forwarded(
    tmp_path: Path, postgres_url: str, upstream: RecordingUpstream
) -> None:
    connect = b"CONNECT bank.test:443 HTTP/1.1\r\nHost: x\r\n\r\n"
    garbage = b"POST /v1/charges HTTP/1.1\r\nHost: x\r\nBad Field: 1\r\n\r\n"
    async with edge_gateway(tmp_path, postgres_url, upstream.url) as gateway:
        tunnel = parse_reply(await exchange(gateway.port, connect))
        malformed = parse_reply(await exchange(gateway.port, garbage))
    assert_closing_problem(tunnel, 400, "tunnel-refused")
    assert_closing_problem(malformed, 400, "malformed-request")
    assert upstream.total == 0


# ------------------------------------------------------------------------ HTTP/1.0 framing


async def test_http10_clients_never_get_chunked_answers(
    tmp_path: Path, postgres_url: str, upstream: RecordingUpstream
) -> None:
    key = new_key()
    streamed = b"GET /v1/stream HTTP/1.0\r\nX-Test-Behavior: stream=3,chunk=100\r\n\r\n"
    keyed = (
        f"POST {CHARGES} HTTP/1.0\r\nIdempotency-Key: {key}\r\nContent-Length: 2\r\n\r\n{{}}"
    ).encode()
    async with edge_gateway(tmp_path, postgres_url, upstream.url) as gateway:
        proxied = parse_reply(await exchange(gateway.port, streamed))
        first = parse_reply(await exchange(gateway.port, keyed))
        replayed = parse_reply(await exchange(gateway.port, keyed))
        chunked_for_11 = parse_reply(
            await exchange(
                gateway.port,
                request(
                    "GET", "/v1/stream", [("X-Test-Behavior", "stream=3"), ("Connection", "close")]
                ),
            )
        )

    assert proxied.status == 200
    assert "transfer-encoding" not in proxied.headers
    assert proxied.headers["connection"] == "close"
    assert len(proxied.body) == 300
    for answer in (first, replayed):
        assert answer.status == 201
        assert "transfer-encoding" not in answer.headers
        assert int(answer.headers["content-length"]) == len(answer.body)
    assert replayed.headers["idempotent-replayed"] == "true"
    assert replayed.body == first.body
    # HTTP/1.1 clients still get the stream chunked, as before.
    assert chunked_for_11.headers["transfer-encoding"] == "chunked"


# ----------------------------------------------------------------------- invalid statuses


@contextlib.asynccontextmanager
async def raw_upstream(status_line: bytes) -> AsyncIterator[tuple[str, list[bytes]]]:
    """An upstream answering every request with ``status_line`` and a two-byte body, written
    raw (aiohttp would not send such statuses); yields its URL and the heads it received."""
    heads: list[bytes] = []

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            heads.append(await reader.readuntil(b"\r\n\r\n"))
            await reader.readexactly(2)  # the test's body, "{}"
            writer.write(status_line + b"\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    async with server:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", heads


@pytest.mark.parametrize(
    "status_line",
    [b"HTTP/1.1 999 Beyond", b"HTTP/1.1 101 Switching Protocols"],
    ids=["999", "101"],
)
async def test_an_invalid_upstream_status_is_a_stored_502_problem(
    tmp_path: Path, postgres_url: str, status_line: bytes
) -> None:
    charge = request("POST", CHARGES, [("Idempotency-Key", new_key())], b"{}")
    async with (
        raw_upstream(status_line) as (url, heads),
        edge_gateway(tmp_path, postgres_url, url, on_ambiguous="fail") as gateway,
    ):
        first = parse_reply(await exchange(gateway.port, charge))
        replayed = parse_reply(await exchange(gateway.port, charge))

    assert (first.status, first.problem_slug) == (502, "upstream-invalid-response")
    assert (replayed.status, replayed.body) == (502, first.body)
    assert replayed.headers["idempotent-replayed"] == "true"
    assert len(heads) == 1


async def test_a_library_app_answering_an_invalid_status_stores_a_502_problem(
    store: RecordStore,
) -> None:
    calls: list[str] = []

    async def broken_app(scope: Scope, receive: Receive, send: Send) -> None:
        calls.append(scope["path"])
        await send({"type": "http.response.start", "status": 999, "headers": []})
        await send({"type": "http.response.body", "body": b"never stored"})

    app = IdempotencyMiddleware(
        broken_app,
        store=store,
        policy={"/": IdempotencyConfig(key="required")},
        scope_secret=TEST_SCOPE_SECRET,
    )
    charge = request("POST", CHARGES, [("Idempotency-Key", new_key())], b"{}")
    async with serve_asgi(app, lifespan="off") as url:
        port = int(url.rsplit(":", 1)[1])
        first = parse_reply(await exchange(port, charge))
        replayed = parse_reply(await exchange(port, charge))

    assert (first.status, first.problem_slug) == (502, "upstream-invalid-response")
    assert (replayed.status, replayed.body) == (502, first.body)
    assert replayed.headers["idempotent-replayed"] == "true"
    assert calls == [CHARGES]


# ------------------------------------------------------------------ slow and oversized heads


def test_limits_have_safe_defaults_load_back_and_refuse_zero_deadlines(tmp_path: Path) -> None:
    defaults = LimitsConfig()
    assert (
        defaults.max_request_head,
        defaults.max_header_fields,
        defaults.request_head_timeout,
        defaults.request_body_timeout,
        defaults.max_connections,
        defaults.keepalive_timeout,
        defaults.max_admin_connections,
    ) == (32 * 1024, 100, 10.0, 60.0, 1000, 75.0, 64)
    tight = gateway_config("http://127.0.0.1:9", limits=TIGHT_LIMITS)
    path = tmp_path / "printed.yaml"
    path.write_text(dump_config(tight), encoding="utf-8")
    assert load_config(path) == tight
    with pytest.raises(ConfigError, match="limits"):
        gateway_config("http://127.0.0.1:9", limits={"request_body_timeout": "0s"})
    with pytest.raises(ConfigError, match=r"limits\.max_request_head"):
        gateway_config("http://127.0.0.1:9", limits={"max_request_head": "100B"})


async def test_an_idle_client_connection_stays_open_for_the_keepalive_timeout(
    tmp_path: Path, postgres_url: str, upstream: RecordingUpstream
) -> None:
    limits = {"keepalive_timeout": "1s"}
    async with edge_gateway(tmp_path, postgres_url, upstream.url, limits=limits) as gateway:
        reader, writer = await asyncio.open_connection("127.0.0.1", gateway.port)
        try:
            writer.write(request("GET", "/"))
            head = await reader.readuntil(b"\r\n\r\n")
            length = parse_reply(head).headers["content-length"]
            await reader.readexactly(int(length))
            loop = asyncio.get_running_loop()
            answered = loop.time()
            rest = await asyncio.wait_for(reader.read(), 30)
            idle = loop.time() - answered
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    assert rest == b""
    # Closed by the setting: neither before it, nor at the server's built-in 5 s.
    assert 0.9 <= idle < 4.0


async def assert_refused(port: int, *writes: bytes, status: int, slug: str) -> None:
    """The gateway answers ``status`` with problem ``slug`` and closes, even while a large
    head is still being written (it lingers rather than reset the answer away)."""
    assert_closing_problem(parse_reply(await exchange(port, *writes)), status, slug)


async def test_oversized_heads_are_431_and_never_forwarded(
    tmp_path: Path, postgres_url: str, upstream: RecordingUpstream
) -> None:
    many_fields = request("GET", "/", [(f"X-Field-{n}", "v") for n in range(25)])
    one_big_field = request("GET", "/", [("X-Big", "a" * 5000)])
    padding = b"X-Padding: " + b"a" * (64 * 1024) + b"\r\n"
    endless = [b"GET / HTTP/1.1\r\nHost: edge.test\r\n", *([padding] * 80)]
    async with edge_gateway(tmp_path, postgres_url, upstream.url, limits=TIGHT_LIMITS) as gateway:
        for writes in ([many_fields], [one_big_field], endless):
            await assert_refused(gateway.port, *writes, status=431, slug="request-head-too-large")
        refused_upstream_calls = upstream.total
        # Just under both limits is an ordinary request.
        fits = request(
            "GET", "/", [("Connection", "close"), *((f"X-Field-{n}", "v" * 100) for n in range(15))]
        )
        answered = parse_reply(await exchange(gateway.port, fits))

    assert refused_upstream_calls == 0
    assert answered.status == 201
    assert upstream.total == 1


async def test_slow_heads_and_bodies_are_408_and_execute_nothing(
    tmp_path: Path, postgres_url: str, upstream: RecordingUpstream
) -> None:
    key = new_key()
    body = b'{"amount": 1000}'
    complete = request("POST", CHARGES, [("Idempotency-Key", key), ("Connection", "close")], body)
    stalled_body = complete[: -len(body) + 3]
    async with edge_gateway(tmp_path, postgres_url, upstream.url, limits=TIGHT_LIMITS) as gateway:
        silent = [exchange(gateway.port) for _ in range(20)]
        trickled = [
            exchange(gateway.port, b"POST /v1/charges HTTP/1.1\r\nHost: x\r\n") for _ in range(30)
        ]
        head_replies = await asyncio.gather(*silent, *trickled)
        body_reply = parse_reply(await exchange(gateway.port, stalled_body))
        # Answered early (413 from Content-Length), then stalled: the connection closes at the
        # body deadline with no second answer the client would take for its next request's.
        early = await exchange(
            gateway.port, b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999\r\n\r\nab"
        )
        nothing_ran = upstream.total
        # The key stayed unused: the same request sent whole executes once.
        retried = parse_reply(await exchange(gateway.port, complete))

    for raw in head_replies:
        assert_closing_problem(parse_reply(raw), 408, "request-timeout")
    assert_closing_problem(body_reply, 408, "request-timeout")
    assert parse_reply(early).status == 413
    assert early.count(b"HTTP/1.1 ") == 1
    assert nothing_ran == 0
    assert retried.status == 201
    assert upstream.count(key) == 1


async def test_connections_beyond_the_cap_are_refused_at_once(
    tmp_path: Path, postgres_url: str, upstream: RecordingUpstream
) -> None:
    cap = 20
    limits = {"max_connections": cap, "request_head_timeout": "60s"}
    async with (
        edge_gateway(tmp_path, postgres_url, upstream.url, limits=limits) as gateway,
        contextlib.AsyncExitStack() as held,
    ):
        writers = []
        for _ in range(cap):
            reader, writer = await asyncio.open_connection("127.0.0.1", gateway.port)
            held.callback(writer.close)
            writers.append((reader, writer))
        # The last held connection is served: all of them were accepted under the cap.
        last_reader, last_writer = writers[-1]
        last_writer.write(request("GET", "/held", [("Connection", "close")]))
        served = parse_reply(await asyncio.wait_for(last_reader.read(), READ_BOUND))
        last_writer.close()

        async def newcomer_is_served() -> bool:
            raw = await exchange(gateway.port, request("GET", "/late", [("Connection", "close")]))
            return parse_reply(raw).status == 201

        # One slot is free again once the gateway saw that close.
        assert await eventually(newcomer_is_served)
        # Now the cap is full again. The probe sends nothing: request bytes arriving after
        # the gateway closed would make the kernel reset the connection under the answer.
        _, extra_writer = await asyncio.open_connection("127.0.0.1", gateway.port)
        held.callback(extra_writer.close)
        refused = parse_reply(await exchange(gateway.port))

    assert served.status == 201
    assert_closing_problem(refused, 503, "too-many-connections")
    assert refused.headers["retry-after"] == "1"
    assert all(e.path != "/refused" for e in upstream.executions)
