"""A replay carries the upstream's headers, but the fields the gateway owns are its own.

The upstream here stamps every answer with a ``Date`` from 2001 and some headers of its own.
``Date`` says when a response is sent (RFC 9110 section 6.6.1), so neither the first answer
nor a replay may carry the upstream's 2001 stamp: each gets the gateway's clock, once. The
upstream's other headers are replayed as stored; ``X-Request-Id`` is the replaying request's,
``Idempotent-Replayed`` appears once, and the framing (``Content-Length``) fits the body.
The 2001 stamp stands in for "long ago", so no test has to wait for time to pass.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime, timedelta
from email.utils import parsedate_to_datetime

import httpx
import pytest
from aiohttp import web

from tests.support.gateway import GatewayLauncher, RunningGateway, gateway_config, route
from tests.support.servers import free_port

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


@pytest.fixture(params=["store", "in-process-cache", "redis-cache"])
async def gateway(
    request: pytest.FixtureRequest, postgres_url: str, redis_url: str
) -> AsyncIterator[RunningGateway]:
    """The replay comes from the store (no cache), the in-process cache or Redis."""
    app = web.Application()
    app.router.add_post("/v1/charges", charge)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        config = gateway_config(
            f"http://127.0.0.1:{port}",
            routes=[route("/", key="required")],
            cache={"max_entries": 0 if request.param == "store" else 100},
        )
        async with GatewayLauncher() as launcher:
            yield await launcher.start(
                config,
                database_url=postgres_url,
                redis_url=redis_url if request.param == "redis-cache" else None,
            )
    finally:
        await runner.cleanup()


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
