"""``Bulkhead`` on its own: a concurrency limit, a bounded FIFO queue and a queue timeout.

Free slots are taken with no queue at all; waiters are served strictly in arrival order and
a newcomer never overtakes them; a full queue refuses at once and a waiter refuses when its
queue timeout passes; a waiter that gives up (or is cancelled in the very instant its slot
arrives) never loses a slot. ``RetrySlot`` takes a free slot only, holds it once, and gives it
back. The config refuses a queue that could outlast the upstream's deadline. The layer
answers a refusal in its route's error format and gives every slot back.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from prometheus_client import REGISTRY

from idempotency_gateway.asgi import Message, Receive, Scope, Send
from idempotency_gateway.config import (
    BulkheadConfig,
    ConfigError,
    ErrorFormat,
    IdempotencyConfig,
    RouteConfig,
    RouteMatch,
)
from idempotency_gateway.errors import CapacityExhausted
from idempotency_gateway.problems import send_problem
from idempotency_gateway.resilience.bulkhead import Bulkhead, BulkheadKind, RetrySlot
from idempotency_gateway.resilience.bulkheads import BulkheadMiddleware, route_bulkheads
from idempotency_gateway.target import STATE_KEY, RequestTarget
from tests.support.gateway import gateway_config, route
from tests.support.waiting import eventually

UPSTREAM_URL = "http://127.0.0.1:9"


def bulkhead(
    name: str, *, max_concurrent: int = 1, max_queued: int = 0, queue_timeout: float = 5.0
) -> Bulkhead:
    config = BulkheadConfig(
        max_concurrent=max_concurrent, max_queued=max_queued, queue_timeout=queue_timeout
    )
    return Bulkhead(BulkheadKind.TIER, name, config)


async def queue_up(limit: Bulkhead) -> asyncio.Task[None]:
    """A request that waits in ``limit``'s queue, once it is there."""
    waiting = limit.queued
    waiter = asyncio.create_task(limit.acquire())
    await eventually(lambda: limit.queued == waiting + 1)
    return waiter


def refusals(name: str, reason: str) -> float:
    value = REGISTRY.get_sample_value(
        "idempotency_gateway_bulkhead_refusals_total",
        {"kind": "tier", "name": name, "reason": reason},
    )
    return value or 0.0


def gauge(metric: str, name: str) -> float | None:
    return REGISTRY.get_sample_value(
        f"idempotency_gateway_bulkhead_{metric}", {"kind": "tier", "name": name}
    )


async def test_free_slots_are_taken_without_queueing_and_given_back() -> None:
    limit = bulkhead("free-slots", max_concurrent=3)

    for _ in range(3):
        await limit.acquire()

    assert (limit.in_flight, limit.queued) == (3, 0)
    limit.publish()
    assert gauge("in_flight", "free-slots") == 3
    assert gauge("max_concurrent", "free-slots") == 3
    for _ in range(3):
        limit.release()
    assert limit.in_flight == 0
    limit.publish()
    assert gauge("in_flight", "free-slots") == 0


async def test_a_full_bulkhead_with_no_queue_refuses_at_once() -> None:
    limit = bulkhead("no-queue", max_concurrent=1)
    await limit.acquire()

    with pytest.raises(CapacityExhausted) as refused:
        await limit.acquire()

    assert refused.value.status == 503
    assert refused.value.retryable is True
    assert refused.value.retry_after == 1
    assert refusals("no-queue", "queue_full") == 1
    assert limit.in_flight == 1


async def test_waiters_are_served_in_arrival_order_and_newcomers_cannot_overtake() -> None:
    limit = bulkhead("fifo", max_concurrent=1, max_queued=3)
    await limit.acquire()
    served: list[int] = []

    async def wait_then_note(number: int) -> None:
        await limit.acquire()
        served.append(number)

    waiters = []
    for number in range(3):
        waiters.append(asyncio.create_task(wait_then_note(number)))
        await eventually(lambda n=number: limit.queued == n + 1)  # type: ignore[misc]
    limit.publish()
    assert gauge("queued", "fifo") == 3

    limit.release()
    await eventually(lambda: served == [0])
    # The slot went to the oldest waiter: a newcomer finds none free, in order or out of it.
    assert not limit.try_acquire()
    assert (limit.in_flight, limit.queued) == (1, 2)
    limit.release()
    await eventually(lambda: served == [0, 1])
    limit.release()
    await eventually(lambda: served == [0, 1, 2])
    await asyncio.gather(*waiters)
    limit.release()
    assert (limit.in_flight, limit.queued) == (0, 0)


async def test_a_full_queue_refuses_at_once_and_a_waiter_refuses_at_its_queue_timeout() -> None:
    limit = bulkhead("timeout", max_concurrent=1, max_queued=1, queue_timeout=0.05)
    await limit.acquire()
    waiter = await queue_up(limit)

    with pytest.raises(CapacityExhausted, match="at capacity"):
        await limit.acquire()
    assert refusals("timeout", "queue_full") == 1
    assert not waiter.done()  # the queued request still waits its turn

    with pytest.raises(CapacityExhausted, match="after waiting"):
        await waiter
    assert refusals("timeout", "queue_timeout") == 1
    assert (limit.in_flight, limit.queued) == (1, 0)
    waited = REGISTRY.get_sample_value(
        "idempotency_gateway_bulkhead_queue_wait_seconds_count", {"kind": "tier", "name": "timeout"}
    )
    assert waited == 1
    limit.release()
    assert limit.in_flight == 0


async def test_a_cancelled_waiter_leaves_the_queue_and_no_slot_is_lost() -> None:
    limit = bulkhead("cancelled", max_concurrent=1, max_queued=2)
    await limit.acquire()
    waiter = await queue_up(limit)

    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter

    assert limit.queued == 0
    limit.release()
    assert limit.in_flight == 0
    await limit.acquire()  # the slot is free again, taken at once
    assert limit.in_flight == 1


async def test_a_slot_handed_to_a_waiter_cancelled_in_the_same_instant_is_passed_on() -> None:
    limit = bulkhead("handover", max_concurrent=1, max_queued=2)
    await limit.acquire()
    first = await queue_up(limit)
    second = await queue_up(limit)

    limit.release()  # the slot is now first's ...
    first.cancel()  # ... but first is cancelled before it runs again
    with pytest.raises(asyncio.CancelledError):
        await first

    await second  # first handed the slot on instead of losing it
    assert (limit.in_flight, limit.queued) == (1, 0)
    limit.release()
    assert limit.in_flight == 0


async def test_a_retry_slot_takes_a_free_slot_once_and_gives_it_back() -> None:
    limit = bulkhead("retry", max_concurrent=2)
    await limit.acquire()
    slot, other = RetrySlot(limit), RetrySlot(limit)

    assert slot.take()
    assert slot.take()  # held already: no second slot
    assert limit.in_flight == 2
    assert not other.take()  # full: the retry is not made
    other.give_back()
    assert limit.in_flight == 2
    slot.give_back()
    slot.give_back()  # once only
    assert limit.in_flight == 1
    assert refusals("retry", "retry_no_slot") == 1
    assert RetrySlot(None).take()


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (
            {
                "bulkheads": {"optional": {"max_concurrent": 1, "max_queued": 1}},
                "routes": [route("/", bulkhead="missing")],
            },
            "names bulkhead 'missing', which is not defined",
        ),
        (
            {
                "bulkheads": {
                    "optional": {"max_concurrent": 1, "max_queued": 1, "queue_timeout": "30s"}
                },
                "routes": [route("/", bulkhead="optional")],
            },
            "queue_timeout (30.0s) must be shorter than the upstream's timeouts.total",
        ),
        (
            {"upstreams": {"slow": {"url": UPSTREAM_URL, "bulkhead": {"max_concurrent": 0}}}},
            "greater than or equal to 1",
        ),
    ],
)
def test_the_config_refuses_unknown_tiers_and_queues_that_outlast_the_deadline(
    settings: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError) as refused:
        gateway_config(UPSTREAM_URL, **settings)
    assert message in str(refused.value)


async def test_the_layer_takes_slots_with_the_body_and_frees_them() -> None:
    route = RouteConfig(
        name="exports",
        match=RouteMatch(path_prefix="/"),
        upstream="primary",
        bulkhead="optional",
        idempotency=IdempotencyConfig(error_format=ErrorFormat.STRIPE),
    )
    tiers = {"optional": BulkheadConfig(max_concurrent=1)}
    passes = route_bulkheads([route], tiers, {"primary": None})
    (tier,) = passes["exports"]
    entered, leave = asyncio.Event(), asyncio.Event()

    async def held_app(scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await receive()  # the slots are taken with the body's last part
        except CapacityExhausted as error:
            await send_problem(send, error, request_id=None, error_format=ErrorFormat.STRIPE)
            return
        entered.set()
        await leave.wait()

    layer = BulkheadMiddleware(held_app, bulkheads=passes)
    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    async def receive() -> Message:
        return {"type": "http.request", "body": b"", "more_body": False}

    def scope() -> Scope:
        target = RequestTarget(b"/v1/exports", b"", route)
        return {"type": "http", "method": "POST", "headers": [], "state": {STATE_KEY: target}}

    first = asyncio.create_task(layer(scope(), receive, send))
    await entered.wait()
    await layer(scope(), receive, send)  # refused while the first holds the only slot

    start, body = sent
    assert start["status"] == 503
    assert (b"retry-after", b"1") in start["headers"]
    error = json.loads(body["body"])["error"]
    assert (error["type"], error["code"]) == ("api_error", "capacity_exhausted")
    leave.set()
    await first
    assert tier.in_flight == 0
