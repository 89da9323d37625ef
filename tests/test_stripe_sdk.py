"""The official ``stripe`` Python SDK, pointed at the gateway, understands the gateway's errors.

With ``idempotency.error_format: stripe`` a route answers the gateway's own errors in Stripe's
error body. The real SDK (its async aiohttp client) talks to a real gateway over loopback, in
front of a small Stripe-like upstream that creates charges: a key reused with other
parameters raises ``stripe.IdempotencyError``; a retry while the first request still runs
gets a 409 ``idempotency_error`` the SDK parses (code ``idempotency_key_in_use``); a
malformed key is an ``InvalidRequestError`` and an unreachable upstream an ``APIError``;
a route left in the default format still answers RFC 9457 problems.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import stripe
from aiohttp import web

from idempotency_gateway.idempotency.keys import MAX_KEY_LENGTH
from tests.support import free_port
from tests.support.gateway import GatewayLauncher, RunningGateway, gateway_config, route
from tests.support.problems import assert_problem

API_KEY = "sk_test_gateway"


class FakeStripe:
    """``POST /v1/charges`` answers a charge object; a held key waits for ``release``."""

    def __init__(self) -> None:
        self.held: dict[str, asyncio.Event] = {}
        self.arrived: dict[str, asyncio.Event] = {}
        self.created: list[str] = []
        self._ids = itertools.count(1)

    def hold(self, key: str) -> None:
        self.held[key] = asyncio.Event()
        self.arrived[key] = asyncio.Event()

    async def charge(self, request: web.Request) -> web.Response:
        form = await request.post()
        key = request.headers.get("Idempotency-Key", "")
        if key in self.held:
            self.arrived[key].set()
            await self.held[key].wait()
        charge_id = f"ch_{next(self._ids)}"
        self.created.append(charge_id)
        return web.json_response(
            {
                "id": charge_id,
                "object": "charge",
                "amount": int(str(form["amount"])),
                "currency": form["currency"],
            }
        )

    def app(self) -> web.Application:
        application = web.Application()
        application.router.add_post("/v1/charges", self.charge)
        return application


@pytest.fixture
async def fake_stripe() -> AsyncIterator[tuple[FakeStripe, str]]:
    fake = FakeStripe()
    runner = web.AppRunner(fake.app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield fake, f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@pytest.fixture
async def gateway(
    fake_stripe: tuple[FakeStripe, str], postgres_url: str
) -> AsyncIterator[RunningGateway]:
    _, url = fake_stripe
    config = gateway_config(
        url,
        routes=[
            route("/v1/charges", key="required", error_format="stripe"),
            route("/", name="problems", key="required"),
        ],
    )
    async with GatewayLauncher() as launcher:
        yield await launcher.start(config, database_url=postgres_url)


@contextlib.asynccontextmanager
async def stripe_sdk(gateway: RunningGateway) -> AsyncIterator[stripe.StripeClient]:
    http_client = stripe.AIOHTTPClient()
    try:
        yield stripe.StripeClient(
            API_KEY,
            base_addresses={"api": gateway.url},
            http_client=http_client,
            # The SDK retries a 409 by itself; these tests look at the answer it parses.
            max_network_retries=0,
        )
    finally:
        await http_client.close_async()  # type: ignore[no-untyped-call]  # untyped in stripe


@pytest.fixture
async def sdk(gateway: RunningGateway) -> AsyncIterator[stripe.StripeClient]:
    async with stripe_sdk(gateway) as client:
        yield client


async def create_charge(client: stripe.StripeClient, key: str, amount: int) -> Any:
    return await client.v1.charges.create_async(
        params={"amount": amount, "currency": "usd", "source": "tok_visa"},
        options={"idempotency_key": key},
    )


def assert_stripe_error(raised: stripe.StripeError, status: int, kind: str, code: str) -> None:
    """The SDK parsed the gateway's body: status, ``error.type`` and ``error.code``."""
    assert raised.http_status == status
    assert raised.error is not None
    assert (raised.error.type, raised.error.code) == (kind, code)


async def test_key_reused_with_other_parameters_raises_idempotency_error(
    sdk: stripe.StripeClient,
    fake_stripe: tuple[FakeStripe, str],
    unique: Callable[[str], str],
) -> None:
    fake, _ = fake_stripe
    key = unique("stripe-reuse")
    charge = await create_charge(sdk, key, 1000)
    assert charge.id == fake.created[-1]
    assert charge.amount == 1000
    replayed = await create_charge(sdk, key, 1000)
    assert replayed.id == charge.id

    with pytest.raises(stripe.IdempotencyError) as raised:
        await create_charge(sdk, key, 2000)

    assert_stripe_error(raised.value, 400, "idempotency_error", "idempotency_key_reused")
    assert fake.created == [charge.id]


async def test_retry_while_the_first_request_runs_gets_a_parsed_409(
    sdk: stripe.StripeClient,
    fake_stripe: tuple[FakeStripe, str],
    unique: Callable[[str], str],
) -> None:
    fake, _ = fake_stripe
    key = unique("stripe-inflight")
    fake.hold(key)
    first = asyncio.create_task(create_charge(sdk, key, 1000))
    await asyncio.wait_for(fake.arrived[key].wait(), timeout=10.0)

    with pytest.raises(stripe.APIError) as raised:
        await create_charge(sdk, key, 1000)

    assert_stripe_error(raised.value, 409, "idempotency_error", "idempotency_key_in_use")
    assert raised.value.headers is not None
    assert raised.value.headers["retry-after"] == "1"
    fake.held[key].set()
    charge = await first
    assert fake.created == [charge.id]


async def test_malformed_key_is_an_invalid_request_error_and_other_routes_keep_problems(
    gateway: RunningGateway, sdk: stripe.StripeClient
) -> None:
    # The SDK always sends a key of its own on POST, so a missing key cannot happen through
    # it; an over-long one is the client-side mistake it can make.
    with pytest.raises(stripe.InvalidRequestError) as raised:
        await create_charge(sdk, "k" * (MAX_KEY_LENGTH + 1), 1000)
    assert_stripe_error(raised.value, 400, "invalid_request_error", "idempotency_key_invalid")

    problem = await gateway.client.post("/v1/refunds", json={})
    assert_problem(problem, 400, "idempotency-key-missing")


async def test_unreachable_upstream_is_an_api_error(
    postgres_url: str, unique: Callable[[str], str]
) -> None:
    config = gateway_config(
        f"http://127.0.0.1:{free_port()}",
        routes=[route("/", key="required", error_format="stripe")],
        retry={"max_attempts": 1},
    )
    async with GatewayLauncher() as launcher:
        running = await launcher.start(config, database_url=postgres_url)
        async with stripe_sdk(running) as client:
            with pytest.raises(stripe.APIError) as raised:
                await create_charge(client, unique("stripe-5xx"), 1000)
    assert_stripe_error(raised.value, 502, "api_error", "upstream_unreachable")


async def test_ambiguous_timeout_is_an_api_error_and_so_is_its_replay(
    fake_stripe: tuple[FakeStripe, str], postgres_url: str, unique: Callable[[str], str]
) -> None:
    fake, url = fake_stripe
    key = unique("stripe-timeout")
    fake.hold(key)  # never released: the upstream takes the charge and never answers
    config = gateway_config(
        url,
        routes=[route("/", key="required", error_format="stripe", on_ambiguous="fail")],
        timeouts={"per_try": "300ms", "total": "2s"},
        retry={"max_attempts": 1},
    )
    async with GatewayLauncher() as launcher:
        running = await launcher.start(config, database_url=postgres_url)
        async with stripe_sdk(running) as client:
            with pytest.raises(stripe.APIError) as first:
                await create_charge(client, key, 1000)
            with pytest.raises(stripe.APIError) as replay:
                await create_charge(client, key, 1000)
        fake.held[key].set()
    for raised in (first, replay):
        assert_stripe_error(raised.value, 504, "api_error", "upstream_timeout")
    assert replay.value.headers is not None
    assert replay.value.headers["idempotent-replayed"] == "true"
