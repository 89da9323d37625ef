"""A hostile client against a real ``idempotency-gateway serve`` process, over raw sockets.

Each test is an attack that once got through: the recording upstream says what reached it,
and the gateway's answer says what the attacker got back. The invariants: an unkeyed request
never reaches a ``key: required`` route, no client gets the answer of a different request,
and no request body can stall a worker.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from idempotency_gateway.asgi import Receive, Scope, Send
from idempotency_gateway.telemetry.request_log import AccessLogMiddleware
from tests.support import GatewayProcess, RecordingUpstream, serve_asgi
from tests.support.charges import CHARGES
from tests.support.edge import Reply, edge_gateway, exchange, parse_reply, request

pytestmark = pytest.mark.slow

CREDENTIAL = ("Authorization", "Bearer attacker")


def attacked_gateway(
    tmp_path: Path, postgres_url: str, upstream_url: str
) -> contextlib.AbstractAsyncContextManager[GatewayProcess]:
    """Charges need a key and a credential; everything else is proxied unprotected."""
    return edge_gateway(
        tmp_path, postgres_url, upstream_url, on_ambiguous="fail", anonymous="refuse"
    )


@pytest.fixture
async def upstream() -> AsyncIterator[RecordingUpstream]:
    async with RecordingUpstream() as recording:
        yield recording


def new_key() -> str:
    return f"attack-{uuid.uuid4()}"


def keyed(key: str, body: bytes, *, target: str = CHARGES) -> bytes:
    fields = [CREDENTIAL, ("Idempotency-Key", key), ("Content-Type", "application/json")]
    return request("POST", target, [*fields, ("Connection", "close")], body)


# ------------------------------------------------------------------------ fingerprint cost


async def test_a_number_with_a_million_trailing_zeros_does_not_stall_the_fingerprint(
    tmp_path: Path, postgres_url: str, upstream: RecordingUpstream
) -> None:
    # Dropping trailing zeros one at a time was quadratic: this body held a worker's event
    # loop for minutes, so the exchange's read bound (a hang, not a speed) ran out.
    key = new_key()
    body = b'{"amount": 1' + b"0" * 1_000_000 + b"}"
    async with attacked_gateway(tmp_path, postgres_url, upstream.url) as gateway:
        first = parse_reply(await exchange(gateway.port, keyed(key, body)))
        retry = parse_reply(await exchange(gateway.port, keyed(key, body)))

    assert first.status == 201
    assert (retry.status, retry.headers["idempotent-replayed"]) == (201, "true")
    [execution] = upstream.executions_for(key)
    assert execution.body == body


# ------------------------------------------------------------------- routes and policies


@pytest.mark.parametrize(
    "target",
    ["/v1/charges;jsessionid=1", "/v1;x/charges", "/v1/;x/charges", "/v1/charges;a/ch_1"],
)
async def test_path_parameters_never_take_a_request_out_of_its_route(
    tmp_path: Path, postgres_url: str, upstream: RecordingUpstream, target: str
) -> None:
    # Servlet containers drop ";parameters" from each segment: an unkeyed POST to
    # /v1/charges;x=1 ran /v1/charges upstream while the gateway saw no such route.
    test_id = new_key()
    unkeyed = request(
        "POST", target, [CREDENTIAL, ("X-Test-Id", test_id), ("Connection", "close")], b"{}"
    )
    key = new_key()
    async with attacked_gateway(tmp_path, postgres_url, upstream.url) as gateway:
        refused = parse_reply(await exchange(gateway.port, unkeyed))
        protected = parse_reply(await exchange(gateway.port, keyed(key, b"{}", target=target)))
        replayed = parse_reply(await exchange(gateway.port, keyed(key, b"{}", target=target)))

    assert (refused.status, refused.problem_slug) == (400, "idempotency-key-missing")
    assert upstream.executions_of_test_id(test_id) == []
    assert protected.status == 201
    assert replayed.headers["idempotent-replayed"] == "true"
    [execution] = upstream.executions_for(key)
    assert execution.raw_path == target


# ------------------------------------------------------------------ fields that reroute


@pytest.mark.parametrize(
    ("method", "field"),
    [
        ("POST", ("X-Original-URL", CHARGES)),
        ("POST", ("X-Rewrite-URL", CHARGES)),
        ("GET", ("X-HTTP-Method-Override", "POST")),
        ("GET", ("X-HTTP-Method", "POST")),
        ("GET", ("x-method-override", "POST")),
    ],
)
async def test_a_field_naming_another_target_or_method_is_refused(
    tmp_path: Path,
    postgres_url: str,
    upstream: RecordingUpstream,
    method: str,
    field: tuple[str, str],
) -> None:
    # Frameworks behind a proxy obey these fields: the upstream would have run an unkeyed
    # POST /v1/charges that the gateway routed as /public, or as a safe (retried) GET.
    test_id = new_key()
    fields = [CREDENTIAL, field, ("X-Test-Id", test_id), ("Connection", "close")]
    async with attacked_gateway(tmp_path, postgres_url, upstream.url) as gateway:
        reply = parse_reply(await exchange(gateway.port, request(method, "/public", fields, b"{}")))

    assert (reply.status, reply.problem_slug) == (400, "request-target-invalid")
    assert field[0].lower() in reply.body.decode().lower()
    assert upstream.executions_of_test_id(test_id) == []


# ------------------------------------------------------------------------------- scopes


@pytest.mark.parametrize("raw_field", [b"Authorization:", b"Authorization: \t "])
async def test_an_empty_credential_is_no_credential(
    tmp_path: Path, postgres_url: str, upstream: RecordingUpstream, raw_field: bytes
) -> None:
    # An empty Authorization field was hashed as a credential: a scope shared by everyone
    # sending one, past the route's refusal of anonymous keyed requests.
    key = new_key()
    charge = (
        f"POST {CHARGES} HTTP/1.1\r\nHost: edge.test\r\nIdempotency-Key: {key}\r\n".encode()
        + raw_field
        + b"\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}"
    )
    async with attacked_gateway(tmp_path, postgres_url, upstream.url) as gateway:
        reply = parse_reply(await exchange(gateway.port, charge))

    assert (reply.status, reply.problem_slug) == (401, "credential-required")
    assert upstream.executions_for(key) == []


# ------------------------------------------------------------------------- false replays


async def test_reordered_values_of_one_query_field_are_another_request(
    tmp_path: Path, postgres_url: str, upstream: RecordingUpstream
) -> None:
    # The query was sorted pair by pair: amount=1&amount=1000 and amount=1000&amount=1 shared
    # a fingerprint, so the second, which a last-value-wins upstream reads as amount=1, got
    # the first one's answer replayed.
    key = new_key()

    async def charge(query: str) -> Reply:
        target = f"{CHARGES}?{query}"
        return parse_reply(await exchange(gateway.port, keyed(key, b"{}", target=target)))

    async with attacked_gateway(tmp_path, postgres_url, upstream.url) as gateway:
        first = await charge("amount=1&amount=1000&currency=usd")
        values_reordered = await charge("amount=1000&amount=1&currency=usd")
        names_reordered = await charge("currency=usd&amount=1&amount=1000")

    assert first.status == 201
    assert (values_reordered.status, values_reordered.problem_slug) == (
        422,
        "idempotency-key-reused",
    )
    assert names_reordered.headers["idempotent-replayed"] == "true"
    assert len(upstream.executions_for(key)) == 1


# ---------------------------------------------------------------------- header values


async def test_a_wait_of_five_thousand_digits_is_only_a_long_wait(
    tmp_path: Path, postgres_url: str, upstream: RecordingUpstream
) -> None:
    # int() refuses strings over 4300 digits: this was a plain-text 500.
    key = new_key()
    charge = request(
        "POST",
        CHARGES,
        [CREDENTIAL, ("Idempotency-Key", key), ("Prefer", "wait=" + "9" * 5000)],
        b"{}",
    )
    async with attacked_gateway(tmp_path, postgres_url, upstream.url) as gateway:
        reply = parse_reply(await exchange(gateway.port, charge))
        assert "Traceback" not in gateway.log_text()

    assert reply.status == 201
    assert len(upstream.executions_for(key)) == 1


@pytest.mark.parametrize(
    ("encoded", "fields"),
    [
        (b"\xef\xbb\xbf" + b'{"amount": 1000}', []),
        ('{"amount": 1000}'.encode("utf-16"), []),
        (b'{"amount": 1000}', [("Content-Encoding", "gzip")]),
    ],
    ids=["utf-8-bom", "utf-16", "content-encoding"],
)
async def test_a_body_the_upstream_would_decode_differently_is_another_request(
    tmp_path: Path,
    postgres_url: str,
    upstream: RecordingUpstream,
    encoded: bytes,
    fields: list[tuple[str, str]],
) -> None:
    # json.loads reads UTF-16, UTF-32 and a BOM, and Content-Encoding was not fingerprinted:
    # these bodies, which many upstreams refuse or decode to something else, got the plain
    # UTF-8 request's answer replayed.
    key = new_key()
    plain = keyed(key, b'{"amount": 1000}')
    other = request(
        "POST",
        CHARGES,
        [CREDENTIAL, ("Idempotency-Key", key), ("Content-Type", "application/json"), *fields],
        encoded,
    )
    async with attacked_gateway(tmp_path, postgres_url, upstream.url) as gateway:
        first = parse_reply(await exchange(gateway.port, plain))
        second = parse_reply(await exchange(gateway.port, other))

    assert first.status == 201
    assert (second.status, second.problem_slug) == (422, "idempotency-key-reused")
    assert len(upstream.executions_for(key)) == 1


# ---------------------------------------------------------------------- request heads


REFUSED_HEADS = {
    "two hosts": b"GET /public HTTP/1.1\r\nHost: a.test\r\nHost: b.test\r\n",
    "no host": b"GET /public HTTP/1.1\r\n",
    "a host with a path": b"GET /public HTTP/1.1\r\nHost: evil.test/../admin\r\n",
    "a host not in ASCII": b"GET /public HTTP/1.1\r\nHost: \xff.test\r\n",
    "two hosts in HTTP/1.0": b"GET /public HTTP/1.0\r\nHost: a.test\r\nHost: b.test\r\n",
    "an HTTP/2.0 request line": b"GET /public HTTP/2.0\r\nHost: a.test\r\n",
    "HTTP/0.9": b"GET /public\r\n",
    "two hosts and an upgrade offer": b"GET /public HTTP/1.1\r\nHost: a.test\r\nHost: b.test\r\n"
    b"Connection: Upgrade\r\nUpgrade: h2c\r\n",
}
SERVED_HEADS = {
    "an IPv6 literal": b"GET /public HTTP/1.1\r\nHost: [::1]:8080\r\n",
    "a name": b"GET /public HTTP/1.1\r\nHost: api.example.com\r\n",
    "an empty host": b"GET /public HTTP/1.1\r\nHost:\r\n",
    "HTTP/1.0 without a host": b"GET /public HTTP/1.0\r\n",
}


async def test_heads_rfc_9112_says_to_refuse_are_refused(
    tmp_path: Path, postgres_url: str, upstream: RecordingUpstream
) -> None:
    # They were proxied: the first Host became X-Forwarded-Host (which applications build
    # links from) whatever the others said, and HTTP/0.9 or 2.0 was answered as HTTP/1.1.
    async with attacked_gateway(tmp_path, postgres_url, upstream.url) as gateway:
        refused = {
            case: parse_reply(await exchange(gateway.port, head + b"\r\n"))
            for case, head in REFUSED_HEADS.items()
        }
        served = {
            case: parse_reply(await exchange(gateway.port, head + b"Connection: close\r\n\r\n"))
            for case, head in SERVED_HEADS.items()
        }

    for case, reply in refused.items():
        assert (reply.status, reply.problem_slug) == (400, "malformed-request"), case
        assert reply.headers["connection"] == "close", case
    for case, reply in served.items():
        assert reply.status == 201, case
    assert upstream.total == len(SERVED_HEADS)


# ---------------------------------------------------------------- the last line of defence


async def failing_app(scope: Scope, receive: Receive, send: Send) -> None:
    """Fails before answering on /before, after its response head on /after."""
    if scope["path"] == "/after":
        await send({"type": "http.response.start", "status": 200, "headers": []})
    raise RuntimeError("a bug")


async def test_an_unexpected_error_is_a_500_problem_not_a_plain_text_page() -> None:
    # A 5000-digit Prefer: wait once reached the server's plain-text 500 this way.
    async with serve_asgi(AccessLogMiddleware(failing_app), lifespan="off") as url:
        port = int(url.rsplit(":", 1)[1])
        before = parse_reply(
            await exchange(port, request("GET", "/before", [("X-Request-Id", "req-1")]))
        )
        after = await exchange(port, request("GET", "/after", [("Connection", "close")]))

    assert (before.status, before.problem_slug) == (500, "internal-error")
    assert b"a bug" not in before.body
    assert b'"request_id":"req-1"' in before.body
    # Once a head went out nothing can replace it: the answer is cut short, never doubled.
    assert after.startswith(b"HTTP/1.1 200 ")
    assert after.count(b"HTTP/1.1 ") == 1


async def test_a_retry_with_other_path_parameters_never_executes_twice(
    tmp_path: Path, postgres_url: str, upstream: RecordingUpstream
) -> None:
    # A servlet upstream runs /v1/charges for both: as two records they were two charges.
    key = new_key()
    async with attacked_gateway(tmp_path, postgres_url, upstream.url) as gateway:
        first = parse_reply(
            await exchange(gateway.port, keyed(key, b"{}", target=f"{CHARGES};jsessionid=a"))
        )
        renewed = parse_reply(
            await exchange(gateway.port, keyed(key, b"{}", target=f"{CHARGES};jsessionid=b"))
        )

    assert first.status == 201
    assert (renewed.status, renewed.problem_slug) == (422, "idempotency-key-reused")
    assert len(upstream.executions_for(key)) == 1
