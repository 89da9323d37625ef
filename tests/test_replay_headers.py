"""A replay carries the upstream's headers, but the fields the gateway owns are its own.

The upstream here stamps every answer with a ``Date`` from 2001 and some headers of its own.
``Date`` says when a response is sent (RFC 9110 section 6.6.1), so neither the first answer
nor a replay may carry the upstream's 2001 stamp: each gets the gateway's clock, once. The
upstream's other headers are replayed as stored; ``X-Request-Id`` is the replaying request's,
``Idempotent-Replayed`` appears once, and the framing (``Content-Length``) fits the body.
The 2001 stamp stands in for "long ago", so no test has to wait for time to pass.

The replay marker's name is a setting, gateway-wide and per route (``replay_header``), for
clients of the IETF draft that expect ``Idempotency-Replayed``.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime, timedelta
from email.utils import parsedate_to_datetime

import httpx
import pytest
from aiohttp import web
from hypothesis import given
from hypothesis import strategies as st

from benchmarks.processes import free_port
from idempotency_gateway.config import ConfigError, validate_config
from idempotency_gateway.storage.records import StoredResponse
from tests.support.gateway import GatewayLauncher, RunningGateway, gateway_config, route

UPSTREAM_DATE = "Mon, 01 Jan 2001 00:00:00 GMT"
UPSTREAM_HEADERS = {
    "ETag": '"charge-v1"',
    "Cache-Control": "private, max-age=0",
    "X-Upstream-Region": "eu-west-1",
    "Date": UPSTREAM_DATE,
}
# Date has one-second resolution and servers refresh it once a second.
CLOCK_RESOLUTION = timedelta(seconds=2)


async def charge(request: web.Request) -> web.Response:
    return web.json_response({"id": "ch_1"}, status=201, headers=UPSTREAM_HEADERS)


@contextlib.asynccontextmanager
async def charges_upstream() -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_post("/{path:.*}", charge)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@pytest.fixture(params=["store", "in-process-cache", "redis-cache"])
async def gateway(
    request: pytest.FixtureRequest, postgres_url: str, redis_url: str
) -> AsyncIterator[RunningGateway]:
    """The replay comes from the store (no cache), the in-process cache or Redis."""
    async with charges_upstream() as upstream_url:
        config = gateway_config(
            upstream_url,
            routes=[route("/", key="required")],
            cache={"max_entries": 0 if request.param == "store" else 100},
        )
        async with GatewayLauncher() as launcher:
            yield await launcher.start(
                config,
                database_url=postgres_url,
                redis_url=redis_url if request.param == "redis-cache" else None,
            )


def sent_now(response: httpx.Response, before: datetime) -> bool:
    (date,) = response.headers.get_list("date")
    return parsedate_to_datetime(date) >= before - CLOCK_RESOLUTION


async def test_replay_has_a_fresh_date_and_the_upstreams_other_headers(
    gateway: RunningGateway, unique: Callable[[str], str]
) -> None:
    key = unique("dated")
    headers = {"Idempotency-Key": key, "Authorization": "Bearer sk_dated"}
    before = datetime.now(UTC)
    first = await gateway.client.post(
        "/v1/charges", json={}, headers={**headers, "X-Request-Id": "first-request"}
    )
    replay = await gateway.client.post(
        "/v1/charges", json={}, headers={**headers, "X-Request-Id": "replaying-request"}
    )

    assert first.status_code == replay.status_code == 201
    assert replay.headers["idempotent-replayed"] == "true"
    for answer in (first, replay):
        assert sent_now(answer, before), answer.headers["date"]
        assert UPSTREAM_DATE not in answer.headers.get_list("date")
        for name in ("ETag", "Cache-Control", "X-Upstream-Region"):
            assert answer.headers.get_list(name) == [UPSTREAM_HEADERS[name]], name
        assert answer.headers.get_list("content-length") == [str(len(answer.content))]
        assert "transfer-encoding" not in answer.headers
    assert replay.headers.get_list("idempotent-replayed") == ["true"]
    assert first.headers.get_list("x-request-id") == ["first-request"]
    assert replay.headers.get_list("x-request-id") == ["replaying-request"]
    assert replay.content == first.content


@pytest.mark.parametrize("cached", [False, True], ids=["from-store", "from-cache"])
async def test_the_replay_marker_is_named_by_the_gateway_and_by_a_route(
    postgres_url: str, unique: Callable[[str], str], cached: bool
) -> None:
    async with charges_upstream() as upstream_url, GatewayLauncher() as launcher:
        gateway = await launcher.start(
            gateway_config(
                upstream_url,
                routes=[
                    route("/v1/legacy", key="required", replay_header="Idempotent-Replayed"),
                    route("/", key="required"),
                ],
                replay_header="Idempotency-Replayed",
                cache={"max_entries": 100 if cached else 0},
            ),
            database_url=postgres_url,
        )
        marked: dict[str, tuple[httpx.Response, httpx.Response]] = {}
        for path in ("/v1/charges", "/v1/legacy/charges"):
            headers = {"Idempotency-Key": unique("marker"), "Authorization": "Bearer sk_marker"}
            first = await gateway.client.post(path, json={}, headers=headers)
            marked[path] = first, await gateway.client.post(path, json={}, headers=headers)

    first, replay = marked["/v1/charges"]
    assert replay.headers.get_list("idempotency-replayed") == ["true"]
    assert "idempotent-replayed" not in replay.headers
    assert "idempotency-replayed" not in first.headers
    first, replay = marked["/v1/legacy/charges"]
    assert replay.headers.get_list("idempotent-replayed") == ["true"]
    assert "idempotency-replayed" not in replay.headers
    assert "idempotent-replayed" not in first.headers


@pytest.mark.parametrize("where", ["gateway", "route"])
def test_a_replay_marker_that_is_no_header_name_is_refused(where: str) -> None:
    data = gateway_config("http://127.0.0.1:9").model_dump(mode="json")
    section = data if where == "gateway" else data["routes"][0]["idempotency"]
    section["replay_header"] = "Idempotency Replayed"
    with pytest.raises(ConfigError, match=r"replay_header.*not a header field name"):
        validate_config(data, source="test")


@given(
    st.lists(
        st.tuples(
            st.text(st.characters(min_codepoint=0x21, max_codepoint=0xFF), min_size=1),
            st.text(st.characters(min_codepoint=0x20, max_codepoint=0xFF)),
        )
    )
)
def test_a_stored_answers_fields_go_out_as_they_came_in(headers: list[tuple[str, str]]) -> None:
    """Encoded once and kept for every later replay of the same copy; the copy itself (its
    equality, what the store and the cache write) is what it was."""
    response = StoredResponse(201, headers, b"{}")
    fresh = StoredResponse(201, list(headers), b"{}")

    wire = response.wire_headers()

    assert wire == tuple((n.encode("latin-1"), v.encode("latin-1")) for n, v in headers)
    assert response.wire_headers() is wire
    assert response == fresh
    assert response.headers == headers
