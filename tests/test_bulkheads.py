"""Bulkheads through the real gateway: a slow route cannot starve a critical one.

The proof runs one gateway process with one worker in front of one upstream, whose pool has 8
connections. ``/v1/exports`` (tier ``optional``: 4 at once, 4 queued for 100ms) is held at
the upstream and flooded; ``/v1/charges`` (tier ``critical``) runs alongside. Without the
tiers the flood would take all 8 connections and every charge would wait for one until its
deadline. With them:

- the charges route's p99 under the flood stays within ``P99_FACTOR`` (30) times its p99
  measured unloaded in the same test, and not one charge is refused;
- every export beyond the tier's capacity gets its 503 ``capacity-exhausted`` problem while
  the admitted exports are still held at the upstream, so at once (or after the 100ms queue
  timeout), never at its deadline (120s here, so that the held exports outlast the test);
- no key executes twice, no refused key leaves a record behind, and a refused key sent again
  once there is room executes once.

Retries take a slot of the upstream's bulkhead too: with the upstream's only slot held by the
request itself, a 503 is not retried; with a second slot free, it is.
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import httpx
import pytest

from idempotency_gateway.config import StoreConfig
from idempotency_gateway.storage import open_store
from idempotency_gateway.storage.base import RecordStore
from tests.support.gateway import PRIMARY, GatewayLauncher, gateway_config, route
from tests.support.keyed import AUTHORIZATION, record_key, send_keyed
from tests.support.problems import assert_problem
from tests.support.servers import GatewayProcess, StartGatewayProcess
from tests.support.upstream import RecordingUpstream
from tests.support.waiting import eventually

pytestmark = pytest.mark.slow

CHARGES = "/v1/charges"
EXPORTS = "/v1/exports"
OPTIONAL_SLOTS = 4
OPTIONAL_QUEUE = 4
# How much slower the charges route may get under the flood: generous, because the flood's
# refusals share the gateway worker's CPU, and the flooding clients the test's own event loop,
# with the charges (a shared 2-core machine at load 10 measured about 7x). Without the tiers
# a charge would wait for a pooled connection until its deadline: over a thousand times.
P99_FACTOR = 30
# Unloaded p99s below this are scheduling noise; the factor applies to at least this much.
P99_FLOOR = 0.020
SAMPLES = 100
# Clients flooding the exports route, each sending its next export as soon as the last is
# refused: OPTIONAL_QUEUE of them wait out the queue timeout, the rest are refused at once.
FLOODERS = OPTIONAL_QUEUE + 2
HELD = "held-export"


def p99(latencies: list[float]) -> float:
    ordered = sorted(latencies)
    return ordered[math.ceil(0.99 * len(ordered)) - 1]


def tiers_config(upstream_url: str) -> dict[str, Any]:
    config = gateway_config(
        upstream_url,
        upstreams={
            PRIMARY: {
                "url": upstream_url,
                # The held exports must outlast the whole test, however slow the machine.
                "timeouts": {"per_try": "120s", "total": "120s"},
                "pool": {"max_connections": 8},
                "retry": {"max_attempts": 1},
                "bulkhead": {"max_concurrent": 64},
            }
        },
        bulkheads={
            "critical": {"max_concurrent": 16},
            "optional": {
                "max_concurrent": OPTIONAL_SLOTS,
                "max_queued": OPTIONAL_QUEUE,
                "queue_timeout": "100ms",
            },
        },
        routes=[
            route(CHARGES, name="charges", key="required", bulkhead="critical"),
            route(EXPORTS, name="exports", key="required", bulkhead="optional"),
        ],
    )
    return config.model_dump(mode="json")


@pytest.fixture
async def one_worker(
    upstream: RecordingUpstream, start_gateway_process: StartGatewayProcess, postgres_url: str
) -> GatewayProcess:
    return await start_gateway_process(
        tiers_config(upstream.url), env={"GATEWAY_DATABASE_URL": postgres_url}
    )


@pytest.fixture
async def store(postgres_url: str) -> AsyncIterator[RecordStore]:
    records = open_store(postgres_url, StoreConfig())
    yield records
    await records.close()


def new_key() -> str:
    return f"bulkhead-{uuid.uuid4()}"


async def timed_charges(client: httpx.AsyncClient, keys: list[str]) -> list[float]:
    latencies = []
    for key in keys:
        started = time.perf_counter()
        response = await send_keyed(client, key, path=CHARGES)
        latencies.append(time.perf_counter() - started)
        assert response.status_code == 201, response.text  # not one charge refused
    return latencies


async def _sampled_after_the_charges(scrape: Awaitable[str]) -> str | None:
    """The scrape once the gauges show the held exports and no charge in flight."""
    text = await scrape
    held = f'bulkhead_in_flight{{kind="tier",name="optional"}} {OPTIONAL_SLOTS}.0' in text
    idle = 'bulkhead_in_flight{kind="tier",name="critical"} 0.0' in text
    return text if held and idle else None


def assert_capacity_exhausted(response: httpx.Response) -> None:
    problem = assert_problem(response, 503, "capacity-exhausted")
    assert problem["retryable"] is True
    assert response.headers["retry-after"] == "1"


async def test_a_flooded_slow_route_cannot_starve_the_critical_route_on_its_upstream(
    one_worker: GatewayProcess, upstream: RecordingUpstream, store: RecordStore
) -> None:
    async with httpx.AsyncClient(base_url=one_worker.url, timeout=120.0, trust_env=False) as client:
        await timed_charges(client, [new_key() for _ in range(10)])  # connections warmed up
        unloaded_keys = [new_key() for _ in range(SAMPLES)]
        unloaded = p99(await timed_charges(client, unloaded_keys))

        held_keys = [new_key() for _ in range(OPTIONAL_SLOTS)]
        held = [
            asyncio.create_task(send_keyed(client, key, path=EXPORTS, behavior=f"gate={HELD}"))
            for key in held_keys
        ]
        await eventually(lambda: upstream.arrivals(HELD) == OPTIONAL_SLOTS)

        # The tier is full: a burst larger than its queue is refused, all of it while the
        # admitted exports are still held at the upstream.
        burst_keys = [new_key() for _ in range(OPTIONAL_SLOTS + OPTIONAL_QUEUE + 28)]
        burst = await asyncio.gather(
            *(send_keyed(client, key, path=EXPORTS, behavior=f"gate={HELD}") for key in burst_keys)
        )
        for response in burst:
            assert_capacity_exhausted(response)
        assert upstream.arrivals(HELD) == OPTIONAL_SLOTS
        assert not any(task.done() for task in held)

        stop = asyncio.Event()
        flood_keys: list[str] = []

        async def flood() -> None:
            while not stop.is_set():
                key = new_key()
                flood_keys.append(key)
                assert_capacity_exhausted(
                    await send_keyed(client, key, path=EXPORTS, behavior=f"gate={HELD}")
                )

        flooders = [asyncio.create_task(flood()) for _ in range(FLOODERS)]
        loaded_keys = [new_key() for _ in range(SAMPLES)]
        try:
            await eventually(lambda: len(flood_keys) >= FLOODERS * 4)
            flooded_before = len(flood_keys)
            loaded = p99(await timed_charges(client, loaded_keys))
            assert len(flood_keys) > flooded_before + FLOODERS  # the flood went on throughout
        finally:
            stop.set()
            await asyncio.gather(*flooders)

        async def metrics() -> str:
            return (await client.get(f"{one_worker.admin_url}/metrics")).text

        # The gauges are sampled every second: the next sample shows the held exports alone.
        sampled = await eventually(
            lambda: _sampled_after_the_charges(metrics()), message="the in-flight gauges"
        )
        for reason in ("queue_full", "queue_timeout"):
            assert f'refusals_total{{kind="tier",name="optional",reason="{reason}"}}' in sampled

        upstream.release(HELD)
        for response in await asyncio.gather(*held):
            assert response.status_code == 201
        # A refused key left nothing behind: sent again with room to spare, it runs once.
        again = await send_keyed(client, burst_keys[0], path=EXPORTS)
        assert again.status_code == 201

    assert loaded <= P99_FACTOR * max(unloaded, P99_FLOOR), (unloaded, loaded)
    refused_keys = burst_keys[1:] + flood_keys
    for key in [*unloaded_keys, *loaded_keys, *held_keys, burst_keys[0]]:
        assert upstream.count(key) == 1
    for key in refused_keys:
        assert upstream.count(key) == 0
    records = await asyncio.gather(*(store.get(record_key(k, path=EXPORTS)) for k in refused_keys))
    assert records == [None] * len(refused_keys)


@pytest.mark.parametrize(("upstream_slots", "attempts"), [(1, 1), (2, 2)])
async def test_a_retry_needs_a_free_slot_of_the_upstreams_bulkhead(
    upstream: RecordingUpstream, postgres_url: str, upstream_slots: int, attempts: int
) -> None:
    config = gateway_config(
        upstream.url,
        upstreams={
            PRIMARY: {
                "url": upstream.url,
                "retry": {"max_attempts": 3, "base": "1ms", "cap": "1ms"},
                "bulkhead": {"max_concurrent": upstream_slots},
            }
        },
        routes=[route("/", key="required")],
    )
    key = new_key()
    async with GatewayLauncher() as gateways:
        gateway = await gateways.start(config, database_url=postgres_url)
        response = await send_keyed(gateway.client, key, behavior="status-first=503")
        slots = gateway.app.upstreams[PRIMARY].bulkhead
        assert slots is not None
        # The request's slot and its retry's both come back once its response has gone out.
        await eventually(lambda: slots.in_flight == 0)

    assert upstream.count(key) == attempts
    # One slot: the request holds it, so its 503 is passed on rather than retried.
    assert response.status_code == (503 if attempts == 1 else 201)


async def test_a_client_trickling_its_body_in_holds_no_slot(
    upstream: RecordingUpstream, postgres_url: str
) -> None:
    config = gateway_config(
        upstream.url,
        upstreams={PRIMARY: {"url": upstream.url, "bulkhead": {"max_concurrent": 1}}},
        routes=[route("/", key="required")],
    )
    slow_key, key = new_key(), new_key()
    body = b'{"amount": 100}'
    head = (
        f"POST {CHARGES} HTTP/1.1\r\nHost: gateway.test\r\nIdempotency-Key: {slow_key}\r\n"
        f"Authorization: {AUTHORIZATION}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nExpect: 100-continue\r\nConnection: close\r\n\r\n"
    ).encode()
    async with GatewayLauncher() as gateways:
        gateway = await gateways.start(config, database_url=postgres_url)
        slots = gateway.app.upstreams[PRIMARY].bulkhead
        assert slots is not None
        host, port = gateway.url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(head + body[:1])
        # The gateway asks for the body once a layer reads it: the head went through routing
        # and the bulkhead layer, and the body is still on its way.
        interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10.0)
        assert interim.startswith(b"HTTP/1.1 100")
        in_flight_while_trickling = slots.in_flight
        # The only slot is free for a client whose body is whole.
        other = await send_keyed(gateway.client, key)
        writer.write(body[1:])
        slow = await asyncio.wait_for(reader.read(), 10.0)
        writer.close()
        await eventually(lambda: slots.in_flight == 0)

    assert in_flight_while_trickling == 0
    assert other.status_code == 201, other.text
    assert slow.startswith(b"HTTP/1.1 201")
    assert upstream.count(slow_key) == upstream.count(key) == 1
