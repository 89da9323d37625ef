"""The gateway as an HTTP intermediary (contract section 6), over real loopback HTTP.

Requests that idempotency does not cover (GET, PUT) pass through the real gateway to a
recording upstream. The tests check what the upstream receives and what the client gets back:
RFC 9110 hop-by-hop rules, ``Via``, ``X-Forwarded-*`` trust, ``X-Request-Id``,
``X-Request-Timeout``, routing, byte-exact targets, no shared cookies, and no silent resend.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

import httpx
import pytest

from tests.support import RecordingUpstream
from tests.support.edge import exchange, parse_reply
from tests.support.edge import request as edge_request
from tests.support.gateway import (
    GatewayLauncher,
    RunningGateway,
    StartGateway,
    gateway_config,
    route,
)
from tests.support.problems import assert_problem
from tests.support.raw_upstream import RawUpstream, Received
from tests.support.upstream import Execution

GENERATED_REQUEST_ID = re.compile(r"^[0-9a-f]{32}$")
VIA = "1.1 idempotency-gateway"


@pytest.fixture
async def gateway(start_gateway: StartGateway, postgres_url: str) -> RunningGateway:
    return await start_gateway(postgres_url)


async def echo(gateway: RunningGateway, upstream: RecordingUpstream, **request: Any) -> Execution:
    """GET ``/v1/echo`` through the gateway; the request as the upstream received it."""
    headers = {"X-Test-Behavior": "echo-headers", **request.pop("headers", {})}
    response = await gateway.client.get("/v1/echo", headers=headers, **request)
    assert response.status_code == 200, response.text
    return upstream.executions[-1]


async def test_unprotected_request_passes_through_with_status_and_body(
    gateway: RunningGateway, upstream: RecordingUpstream
) -> None:
    answers = [
        await gateway.client.get("/v1/things/7", headers={"X-Test-Behavior": "status=404"})
        for _ in range(2)
    ]

    assert [answer.status_code for answer in answers] == [404, 404]
    assert [answer.json()["execution"] for answer in answers] == [1, 2]
    assert answers[0].json()["path"] == "/v1/things/7"
    assert answers[0].headers["x-upstream-execution"] == "1"
    assert all("idempotent-replayed" not in answer.headers for answer in answers)
    assert upstream.total == 2


async def test_hop_by_hop_fields_are_not_forwarded(
    gateway: RunningGateway, upstream: RecordingUpstream
) -> None:
    received = await echo(
        gateway,
        upstream,
        headers={
            "Connection": "keep-alive, X-Secret-Hop",
            "X-Secret-Hop": "1",
            "Keep-Alive": "timeout=5",
            "Proxy-Connection": "keep-alive",
            "TE": "trailers",
            "Trailer": "X-Checksum",
            "Upgrade": "h2c",
            "X-End-To-End": "kept",
            "Authorization": "Bearer token",
        },
    )

    for name in ("x-secret-hop", "keep-alive", "proxy-connection", "te", "trailer", "upgrade"):
        assert name not in received.headers, name
    assert "x-secret-hop" not in received.headers.get("connection", "").lower()
    assert received.headers["x-end-to-end"] == "kept"
    assert received.headers["authorization"] == "Bearer token"


async def test_via_is_added_on_the_request_and_the_response(
    gateway: RunningGateway, upstream: RecordingUpstream
) -> None:
    plain = await gateway.client.get("/v1/things")
    behind_a_proxy = await gateway.client.get("/v1/things", headers={"Via": "1.0 corp-proxy"})

    assert upstream.executions[0].header_values("via") == [VIA]
    assert upstream.executions[1].header_values("via") == [f"1.0 corp-proxy, {VIA}"]
    assert plain.headers["via"] == VIA
    assert behind_a_proxy.headers["via"] == VIA


async def test_forwarded_fields_from_an_untrusted_client_are_replaced(
    gateway: RunningGateway, upstream: RecordingUpstream
) -> None:
    received = await echo(
        gateway,
        upstream,
        headers={
            "X-Forwarded-For": "6.6.6.6",
            "X-Forwarded-Proto": "https",
            "X-Forwarded-Host": "evil.example",
            "X-Forwarded-Prefix": "/v1/charges",
        },
    )

    gateway_host = gateway.url.removeprefix("http://")
    assert received.header_values("x-forwarded-for") == ["127.0.0.1"]
    assert received.header_values("x-forwarded-proto") == ["http"]
    assert received.header_values("x-forwarded-host") == [gateway_host]
    assert received.header_values("x-forwarded-prefix") == []


async def test_forwarded_fields_from_a_trusted_proxy_are_extended(
    start_gateway: StartGateway, postgres_url: str, upstream: RecordingUpstream
) -> None:
    gateway = await start_gateway(postgres_url, trusted_proxies=["127.0.0.1/32"])

    received = await echo(
        gateway,
        upstream,
        headers={
            "X-Forwarded-For": "203.0.113.9",
            "X-Forwarded-Proto": "https",
            "X-Forwarded-Host": "api.example.com",
            "X-Forwarded-Prefix": "/payments",
        },
    )

    assert received.header_values("x-forwarded-for") == ["203.0.113.9, 127.0.0.1"]
    assert received.header_values("x-forwarded-proto") == ["https"]
    assert received.header_values("x-forwarded-host") == ["api.example.com"]
    assert received.header_values("x-forwarded-prefix") == ["/payments"]


async def test_request_id_is_generated_when_absent_and_echoed(
    gateway: RunningGateway, upstream: RecordingUpstream
) -> None:
    response = await gateway.client.get("/v1/things")

    request_id = response.headers["x-request-id"]
    assert GENERATED_REQUEST_ID.match(request_id)
    assert upstream.executions[0].header_values("x-request-id") == [request_id]


async def test_tame_request_id_from_the_client_is_kept(
    gateway: RunningGateway, upstream: RecordingUpstream
) -> None:
    tame = "req-2024.06.01:abc_123"

    response = await gateway.client.get("/v1/things", headers={"X-Request-Id": tame})

    assert response.headers["x-request-id"] == tame
    assert upstream.executions[0].header_values("x-request-id") == [tame]


@pytest.mark.parametrize(
    "malicious",
    [
        pytest.param("id with spaces", id="spaces"),
        pytest.param("a" * 500, id="500-characters"),
        pytest.param("id{}<script>alert(1)</script>", id="markup"),
    ],
)
async def test_malicious_request_id_is_replaced(
    gateway: RunningGateway, upstream: RecordingUpstream, malicious: str
) -> None:
    response = await gateway.client.get("/v1/things", headers={"X-Request-Id": malicious})

    replacement = response.headers["x-request-id"]
    assert GENERATED_REQUEST_ID.match(replacement)
    assert upstream.executions[0].header_values("x-request-id") == [replacement]


@pytest.mark.parametrize(
    ("client_asks", "at_most"),
    [
        pytest.param(None, 10.0, id="route-budget"),
        pytest.param("2.5", 2.5, id="client-shortens"),
        pytest.param("100", 10.0, id="client-cannot-extend"),
    ],
)
async def test_remaining_budget_is_forwarded_as_request_timeout(
    start_gateway: StartGateway,
    postgres_url: str,
    upstream: RecordingUpstream,
    client_asks: str | None,
    at_most: float,
) -> None:
    gateway = await start_gateway(postgres_url, timeouts={"per_try": "10s", "total": "30s"})
    headers = {"X-Request-Timeout": client_asks} if client_asks else {}

    received = await echo(gateway, upstream, headers=headers)

    [forwarded] = received.header_values("x-request-timeout")
    assert 0 < float(forwarded) <= at_most
    # Well within a second of the full budget: the deadline starts when the request arrives.
    assert float(forwarded) > at_most - 1


async def test_path_without_a_route_is_404_problem(
    start_gateway: StartGateway, postgres_url: str, upstream: RecordingUpstream
) -> None:
    gateway = await start_gateway(postgres_url, routes=[route("/v1")])

    response = await gateway.client.get("/v2/things")

    problem = assert_problem(response, 404, "no-route")
    assert "/v2/things" in problem["detail"]
    assert problem["retryable"] is False
    assert problem["request_id"] == response.headers["x-request-id"]
    assert upstream.total == 0


async def test_longest_prefix_wins_on_whole_segments(
    start_gateway: StartGateway, postgres_url: str, upstream: RecordingUpstream
) -> None:
    async with RecordingUpstream() as charges_upstream:
        gateway = await start_gateway(
            postgres_url,
            upstreams={"charges": {"url": charges_upstream.url}},
            routes=[route("/v1"), route("/v1/charges", upstream="charges")],
        )

        for path in ("/v1/charges", "/v1/charges/ch_1", "/v1/chargesX", "/v1/refunds"):
            response = await gateway.client.get(path)
            assert response.status_code == 201

    assert [e.path for e in charges_upstream.executions] == ["/v1/charges", "/v1/charges/ch_1"]
    assert [e.path for e in upstream.executions] == ["/v1/chargesX", "/v1/refunds"]


async def test_a_canonical_path_and_any_query_are_forwarded_byte_for_byte(
    gateway: RunningGateway, upstream: RecordingUpstream
) -> None:
    target = "/v1/files/a%3Ab/caf%C3%A9;v=1/@x:1?b=2&a=%20x&a=1&empty=&flag&plus=1+1&q=%2F..%2F"

    response = await gateway.client.get(target)

    assert response.status_code == 201
    assert response.request.url.raw_path == target.encode()  # httpx sent it untouched
    assert upstream.executions[0].raw_path == target


async def test_cookies_set_for_one_client_never_reach_another(
    gateway: RunningGateway, upstream: RecordingUpstream
) -> None:
    first = await gateway.client.get(
        "/v1/login", headers={"X-Test-Behavior": "set-cookie=session=alice"}
    )
    async with httpx.AsyncClient(base_url=gateway.url, trust_env=False) as someone_else:
        await someone_else.get("/v1/whoami")

    assert first.headers["set-cookie"] == "session=alice"  # passed through to its client
    assert "cookie" not in upstream.executions[1].headers


async def test_put_whose_connection_resets_is_sent_exactly_once(
    gateway: RunningGateway, upstream: RecordingUpstream
) -> None:
    # A pooled connection first: clients that resend silently (aiohttp's did) do it there.
    warm_up = await gateway.client.get("/v1/things")
    assert warm_up.status_code == 201

    response = await gateway.client.put("/v1/things/7", headers={"X-Test-Behavior": "reset"})

    assert_problem(response, 502, "upstream-connection-lost")
    assert [e.method for e in upstream.executions] == ["GET", "PUT"]


@pytest.mark.parametrize(
    "value",
    [
        pytest.param("Zoë, café ☕".encode(), id="utf-8"),
        # obs-text that is not UTF-8 (RFC 9110 section 5.5): passed on as the same bytes, not
        # re-encoded from some decoding of them.
        pytest.param(b"caf\xe9 \xff\xfe", id="latin-1"),
    ],
)
async def test_header_values_reach_the_upstream_byte_for_byte(
    start_gateway: StartGateway, postgres_url: str, upstream: RecordingUpstream, value: bytes
) -> None:
    gateway = await start_gateway(postgres_url)

    response = await gateway.client.get(
        "/echo", headers=[(b"X-Customer-Name", value), (b"X-Test-Behavior", b"echo-headers")]
    )

    assert response.status_code == 200
    (execution,) = upstream.executions
    assert execution.headers["x-customer-name"].encode("utf-8", "surrogateescape") == value


@pytest.mark.parametrize("status", [b"304 Not Modified", b"204 No Content"])
async def test_an_answer_without_content_keeps_the_connection_whatever_its_length_says(
    postgres_url: str, status: bytes
) -> None:
    """A 304 may name the Content-Length of the representation it stands for: the client
    gets the answer without a body and its connection goes on to the next request."""

    async def answer(request: Received, reader: asyncio.StreamReader, writer: Any) -> None:
        if request.head.startswith(b"GET /second "):
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\nsecond")
        else:
            writer.write(b"HTTP/1.1 " + status + b'\r\nETag: "v1"\r\nContent-Length: 1234\r\n\r\n')

    async with RawUpstream(answer) as raw, GatewayLauncher() as launcher:
        gateway = await launcher.start(gateway_config(raw.url), database_url=postgres_url)
        port = int(gateway.url.rsplit(":", 1)[1])
        data = await exchange(
            port,
            edge_request("GET", "/first", [("If-None-Match", '"v1"')])
            + edge_request("GET", "/second", [("Connection", "close")]),
        )

    first, _, rest = data.partition(b"\r\n\r\n")
    assert first.startswith(b"HTTP/1.1 " + status)
    assert b"content-length" not in first.lower()
    second = parse_reply(rest)
    assert (second.status, second.body) == (200, b"second")
