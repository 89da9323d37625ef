"""A circuit breaker never wedges: every admitted call gives its half-open permit back.

A probe that is cancelled (a client that went away, a task cancelled) or that raises
something the breaker cannot judge the upstream by leaves the breaker ready for the next
probe. First the breaker alone on a hand-moved clock, then the retry loop against a real
upstream, then a real gateway whose client hangs up while its probe waits on a slow upstream.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from idempotency_gateway.config import BreakerConfig, UpstreamConfig
from idempotency_gateway.errors import CircuitOpen
from idempotency_gateway.proxy.deadline import Deadline
from idempotency_gateway.proxy.resilient import ResilientUpstream, RetryPlan
from idempotency_gateway.proxy.upstream_client import (
    UpstreamClient,
    UpstreamRequest,
    UpstreamResponse,
)
from idempotency_gateway.resilience.breaker import BreakerState, CircuitBreaker
from tests.support import RecordingUpstream, eventually
from tests.support.clock import ManualClock, state_of
from tests.support.gateway import PRIMARY, GatewayLauncher, gateway_config, route

ONE_PROBE = BreakerConfig(min_calls=1, failure_rate=0.5, open_for=10.0, half_open_calls=1)
PLAN = RetryPlan(idempotent=True, retry_ambiguous=False, ambiguous_statuses=frozenset())


class UnexpectedError(Exception):
    """Stands for a bug of ours: says nothing about the upstream's health."""


def half_open(clock: ManualClock, config: BreakerConfig = ONE_PROBE) -> CircuitBreaker:
    breaker = CircuitBreaker("payments", config, clock=clock)
    with breaker.trial() as trial:
        trial.settle(failure=True)
    clock.advance(config.open_for)
    assert state_of(breaker) is BreakerState.HALF_OPEN
    return breaker


def assert_full(breaker: CircuitBreaker) -> None:
    with pytest.raises(CircuitOpen):
        breaker.trial()


async def test_a_cancelled_probe_hands_its_permit_back() -> None:
    breaker = half_open(ManualClock())
    entered = asyncio.Event()

    async def probe() -> None:
        with breaker.trial():
            entered.set()
            await asyncio.Event().wait()

    task = asyncio.create_task(probe())
    await entered.wait()
    assert_full(breaker)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

    with breaker.trial() as trial:
        trial.settle(failure=False)
    assert state_of(breaker) is BreakerState.CLOSED


def test_a_probe_raising_an_unexpected_error_hands_its_permit_back() -> None:
    breaker = half_open(ManualClock())

    with pytest.raises(UnexpectedError), breaker.trial():
        raise UnexpectedError

    # Neither opened again (no verdict on the upstream) nor stuck: the next probe is let in.
    assert state_of(breaker) is BreakerState.HALF_OPEN
    with breaker.trial() as trial:
        trial.settle(failure=False)
    assert state_of(breaker) is BreakerState.CLOSED


def test_only_the_first_verdict_counts_and_leaving_after_it_changes_nothing() -> None:
    breaker = half_open(ManualClock(), ONE_PROBE.model_copy(update={"half_open_calls": 2}))

    def settle_twice_then_fail() -> None:
        with breaker.trial() as trial:
            trial.settle(failure=False)
            trial.settle(failure=True)
            raise UnexpectedError

    with pytest.raises(UnexpectedError):
        settle_twice_then_fail()

    assert state_of(breaker) is BreakerState.HALF_OPEN
    with breaker.trial() as second:
        second.settle(failure=False)
    assert state_of(breaker) is BreakerState.CLOSED


def test_a_permit_from_an_earlier_state_is_not_handed_back_twice() -> None:
    clock = ManualClock()
    breaker = half_open(clock, ONE_PROBE.model_copy(update={"half_open_calls": 2}))
    stale = breaker.trial()
    breaker.force(BreakerState.FORCED_OPEN)
    breaker.force(None)
    with breaker.trial() as trial:
        trial.settle(failure=True)
    clock.advance(ONE_PROBE.open_for)
    assert state_of(breaker) is BreakerState.HALF_OPEN

    with stale:
        pass
    breaker.trial()
    breaker.trial()
    assert_full(breaker)


@pytest.fixture
async def resilient(
    upstream: RecordingUpstream, clock: ManualClock
) -> AsyncIterator[ResilientUpstream]:
    config = UpstreamConfig(
        url=upstream.url, retry={"max_attempts": 1}, breaker=ONE_PROBE.model_dump()
    )
    client = UpstreamClient("payments", config)
    await client.start()
    yield ResilientUpstream(client, clock=clock)
    await client.close()


def behaving(upstream: RecordingUpstream, behavior: str) -> UpstreamRequest:
    return UpstreamRequest(
        method="GET",
        target=b"/v1/charges",
        headers=[(b"X-Test-Behavior", behavior.encode())],
        body=b"",
    )


async def test_the_retry_loop_hands_back_the_permit_of_a_probe_cancelled_mid_call(
    resilient: ResilientUpstream, upstream: RecordingUpstream, clock: ManualClock
) -> None:
    async def call(behavior: str) -> UpstreamResponse:
        return await resilient.open(
            lambda _: behaving(upstream, behavior),
            deadline=Deadline(10.0, clock=clock),
            plan=PLAN,
        )

    breaker = resilient.breaker
    # Fail once (min_calls 1) to open, then let the open period pass: the next call probes.
    (await call("status=500")).release()
    assert state_of(breaker) is BreakerState.OPEN
    clock.advance(ONE_PROBE.open_for)
    assert state_of(breaker) is BreakerState.HALF_OPEN

    probe = asyncio.create_task(call("gate=probe"))
    await upstream.wait_arrived("probe")
    assert_full(breaker)
    probe.cancel()
    with pytest.raises(asyncio.CancelledError):
        await probe

    answer = await call("status=200")
    answer.release()
    assert answer.status == 200
    assert state_of(breaker) is BreakerState.CLOSED


async def test_a_client_hanging_up_mid_probe_leaves_the_gateway_breaker_admitting(
    upstream: RecordingUpstream, postgres_url: str
) -> None:
    primary = {
        "url": upstream.url,
        "retry": {"max_attempts": 1},
        "breaker": {"min_calls": 1, "open_for": "50ms", "half_open_calls": 1},
    }
    config = gateway_config(
        upstream.url, upstreams={PRIMARY: primary}, routes=[route("/", key="optional")]
    )
    async with GatewayLauncher() as launcher:
        gateway = await launcher.start(config, database_url=postgres_url)
        breaker = gateway.app.upstreams[PRIMARY].breaker
        failing = await gateway.client.get("/v1/charges", headers={"X-Test-Behavior": "status=500"})
        assert failing.status_code == 500
        await eventually(lambda: state_of(breaker) is BreakerState.HALF_OPEN)

        host, port = gateway.url.removeprefix("http://").split(":")
        _, writer = await asyncio.open_connection(host, int(port))
        writer.write(
            b"GET /v1/charges HTTP/1.1\r\nHost: gateway\r\nX-Test-Behavior: gate=probe\r\n\r\n"
        )
        await writer.drain()
        await upstream.wait_arrived("probe")
        writer.close()
        await writer.wait_closed()

        # The gateway stops the probe nobody waits for (the upstream sees the hang-up) ...
        await eventually(lambda: upstream.inflight == 0)
        # ... and the next request is the new probe, which closes the breaker.
        admitted = await gateway.client.get(
            "/v1/charges", headers={"X-Test-Behavior": "status=200"}
        )
        assert admitted.status_code == 200
        assert state_of(breaker) is BreakerState.CLOSED
        assert upstream.total == 3
