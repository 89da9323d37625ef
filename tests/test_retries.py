"""Retries toward upstreams are safe, bounded and explained (contract section 7).

First the retry loop itself (``ResilientUpstream`` with a real aiohttp client against a recording
upstream, on a hand-moved clock with a fake ``sleep``): ``Retry-After`` and full jitter set the
pauses, the deadline and the retry budget end the loop, an open breaker stops it at once, and a
half-open breaker lets exactly ``half_open_calls`` concurrent probes through.

Then the real gateway over loopback HTTP: exact upstream attempt counts for each kind of
failure and request (a keyed or safe request is retried, an unkeyed POST that was sent never
is, one that never left always may be), ``Retry-After`` against the deadline, the client's
``X-Request-Timeout``, the budget under a retry storm, the breaker opening in front of an
upstream that fails, and the log line that says why each request was or was not retried.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

import httpx
import pytest

from idempotency_gateway.config import UpstreamConfig
from idempotency_gateway.errors import CircuitOpen, DeadlineExhausted, LeaseNotConfirmed
from idempotency_gateway.execution import Execution, Outcome
from idempotency_gateway.proxy.deadline import Deadline
from idempotency_gateway.proxy.resilient import RequestFactory, ResilientUpstream, RetryPlan
from idempotency_gateway.proxy.upstream_client import (
    UpstreamClient,
    UpstreamRequest,
    UpstreamResponse,
)
from idempotency_gateway.resilience.breaker import BreakerState
from idempotency_gateway.storage.base import RecordStore
from idempotency_gateway.storage.records import Record, RecordKey, Status
from tests.support import RecordingUpstream, eventually, free_port
from tests.support.charges import CHARGES, keyed_headers
from tests.support.clock import ManualClock, state_of
from tests.support.gateway import (
    PRIMARY,
    RunningGateway,
    StartGateway,
    route,
)
from tests.support.problems import assert_problem

RETRY_LOGGER = "idempotency_gateway.proxy.resilient"
KEYED = RetryPlan(idempotent=True, retry_ambiguous=False, ambiguous_statuses=frozenset({502, 504}))
# Pauses of a millisecond keep the gateway tests fast; the pause math has its own tests.
FAST_RETRY = {"base": "1ms", "cap": "1ms"}


@pytest.fixture
def retry_log(caplog: pytest.LogCaptureFixture) -> Callable[[], list[str]]:
    """The retry loop's log messages so far: each says why it did or did not retry."""
    caplog.set_level(logging.INFO, logger=RETRY_LOGGER)
    return lambda: [r.getMessage() for r in caplog.records if r.name == RETRY_LOGGER]


def count_containing(messages: list[str], text: str) -> int:
    return sum(text in message for message in messages)


def retries_in(messages: list[str]) -> list[str]:
    """The lines announcing a retry (one per extra attempt)."""
    return [message for message in messages if message.startswith("retrying upstream")]


def final_decisions_in(messages: list[str]) -> list[str]:
    """The lines saying why the loop stopped retrying."""
    return [message for message in messages if message.startswith("not retrying upstream")]


# ------------------------------------------------------- the retry loop on a manual clock


def deadline(time: ManualClock, seconds: float) -> Deadline:
    return Deadline(seconds, clock=time)


class MakeResilient(Protocol):
    def __call__(self, **config: Any) -> Awaitable[ResilientUpstream]: ...


@pytest.fixture
async def make_resilient(
    upstream: RecordingUpstream, clock: ManualClock
) -> AsyncIterator[MakeResilient]:
    """``await make_resilient(retry={...}, breaker={...})``: a started ``ResilientUpstream``
    to the recording upstream, on ``clock``."""
    clients: list[UpstreamClient] = []

    async def make(**config: Any) -> ResilientUpstream:
        client = UpstreamClient("payments", UpstreamConfig(url=upstream.url, **config))
        await client.start()
        clients.append(client)
        return ResilientUpstream(client, clock=clock, sleep=clock.sleep, uniform=clock.uniform)

    yield make
    for client in clients:
        await client.close()


def charge_request(upstream: RecordingUpstream, behavior: str, key: str = "k1") -> RequestFactory:
    """A keyed POST to the recording upstream, scripted by ``behavior``."""

    def make(head_within: float) -> UpstreamRequest:
        return UpstreamRequest(
            method="POST",
            target=CHARGES.encode(),
            headers=[
                (b"Idempotency-Key", key.encode()),
                (b"X-Test-Behavior", behavior.encode()),
                (b"X-Request-Timeout", b"%.3f" % head_within),
            ],
            body=b"{}",
        )

    return make


def open_keyed_charge(
    resilient: ResilientUpstream,
    upstream: RecordingUpstream,
    clock: ManualClock,
    behavior: str,
    *,
    key: str = "k1",
    seconds_left: float = 10.0,
    execution: Execution | None = None,
) -> Awaitable[UpstreamResponse]:
    """``resilient.open`` a keyed charge scripted by ``behavior``, with ``seconds_left`` on the
    deadline (ten seconds: more than any retry loop here needs, unless a test says otherwise)."""
    return resilient.open(
        charge_request(upstream, behavior, key),
        deadline=deadline(clock, seconds_left),
        plan=KEYED,
        execution=execution,
    )


class LeaseLostAt:
    """A lease that is confirmed until the confirmation numbered ``lost_at`` (1-based)."""

    def __init__(self, lost_at: int) -> None:
        self.lost_at = lost_at
        self.confirmations: list[bool] = []
        """``fresh`` of each confirmation asked for, in order."""

    async def confirm(self, *, fresh: bool = False) -> None:
        self.confirmations.append(fresh)
        if len(self.confirmations) >= self.lost_at:
            raise LeaseNotConfirmed("another owner took the record over", fenced=True)

    def check(self) -> None:
        if len(self.confirmations) >= self.lost_at:
            raise LeaseNotConfirmed("another owner took the record over", fenced=True)


@pytest.mark.parametrize(
    ("lost_at", "outcome"),
    [(1, Outcome.NOT_EXECUTED), (2, Outcome.AMBIGUOUS)],
    ids=["before-the-first-attempt", "after-the-pause"],
)
async def test_a_lost_lease_ends_the_loop_unsent_unretried_and_without_a_breaker_verdict(
    make_resilient: MakeResilient,
    upstream: RecordingUpstream,
    clock: ManualClock,
    lost_at: int,
    outcome: Outcome,
) -> None:
    resilient = await make_resilient(retry={"max_attempts": 3})
    lease = LeaseLostAt(lost_at)
    execution = Execution("k-lease", 7, lease)

    with pytest.raises(LeaseNotConfirmed):
        await open_keyed_charge(
            resilient, upstream, clock, "status=503", key="k-lease", execution=execution
        )

    # Confirmed before the first attempt, afresh after the pause; nothing after the refusal.
    assert lease.confirmations == [False, True][:lost_at]
    assert upstream.count("k-lease") == lost_at - 1
    assert execution.outcome is outcome
    # Only the attempt that was sent (its 503) told the breaker anything.
    assert resilient.breaker.snapshot().calls == lost_at - 1


async def status_of(answer: Awaitable[UpstreamResponse]) -> int:
    response = await answer
    response.release()
    return response.status


async def test_retry_after_sets_the_pause_between_attempts(
    make_resilient: MakeResilient, upstream: RecordingUpstream, clock: ManualClock
) -> None:
    resilient = await make_resilient(retry={"max_attempts": 3})

    status = await status_of(
        open_keyed_charge(resilient, upstream, clock, "status=503,retry-after=3")
    )

    assert status == 503
    assert upstream.count("k1") == 3
    assert clock.sleeps == [3.0, 3.0]


async def test_retry_after_past_the_deadline_ends_the_loop(
    make_resilient: MakeResilient,
    upstream: RecordingUpstream,
    clock: ManualClock,
    retry_log: Callable[[], list[str]],
) -> None:
    resilient = await make_resilient(retry={"max_attempts": 3})

    status = await status_of(
        open_keyed_charge(resilient, upstream, clock, "status=503,retry-after=20")
    )

    assert status == 503
    assert upstream.count("k1") == 1
    assert clock.sleeps == []
    assert count_containing(retry_log(), "a pause of 20.000s would not leave time") == 1


async def test_pauses_are_full_jitter_growing_to_the_cap(
    make_resilient: MakeResilient, upstream: RecordingUpstream, clock: ManualClock
) -> None:
    resilient = await make_resilient(retry={"max_attempts": 4, "base": "100ms", "cap": "250ms"})

    await status_of(open_keyed_charge(resilient, upstream, clock, "status=503"))

    assert upstream.count("k1") == 4
    assert clock.jitter_bounds == [(0.0, 0.1), (0.0, 0.2), (0.0, 0.25)]
    assert clock.sleeps == [0.1, 0.2, 0.25]


async def test_a_deadline_with_no_time_left_sends_nothing(
    make_resilient: MakeResilient, upstream: RecordingUpstream, clock: ManualClock
) -> None:
    resilient = await make_resilient()

    with pytest.raises(DeadlineExhausted):
        await open_keyed_charge(resilient, upstream, clock, "status=201", seconds_left=0.001)

    assert upstream.total == 0


async def test_an_open_breaker_stops_the_retry_loop_at_once(
    make_resilient: MakeResilient, upstream: RecordingUpstream, clock: ManualClock
) -> None:
    resilient = await make_resilient(
        retry={"max_attempts": 5}, breaker={"min_calls": 2, "failure_rate": 0.5}
    )

    with pytest.raises(CircuitOpen):
        await open_keyed_charge(resilient, upstream, clock, "status=503")

    # The second 503 opened the breaker: attempt 3 asked it and was refused.
    assert upstream.count("k1") == 2
    assert state_of(resilient.breaker) is BreakerState.OPEN


async def test_an_empty_retry_budget_means_no_retry(
    make_resilient: MakeResilient,
    upstream: RecordingUpstream,
    clock: ManualClock,
    retry_log: Callable[[], list[str]],
) -> None:
    resilient = await make_resilient(
        retry={"max_attempts": 3, "budget": {"ratio": 0, "min_per_second": 0}}
    )

    status = await status_of(open_keyed_charge(resilient, upstream, clock, "status=503"))

    assert status == 503
    assert upstream.count("k1") == 1
    assert clock.sleeps == []
    assert count_containing(retry_log(), "the retry budget is exhausted") == 1


async def test_half_open_breaker_lets_only_half_open_calls_concurrent_probes_through(
    make_resilient: MakeResilient, upstream: RecordingUpstream, clock: ManualClock
) -> None:
    resilient = await make_resilient(
        retry={"max_attempts": 1},
        breaker={"min_calls": 2, "failure_rate": 0.5, "open_for": "10s", "half_open_calls": 2},
    )
    for key in ("fail-1", "fail-2"):
        status = await status_of(
            open_keyed_charge(resilient, upstream, clock, "status=500", key=key)
        )
        assert status == 500
    assert state_of(resilient.breaker) is BreakerState.OPEN
    clock.advance(10.0)

    attempts = [
        asyncio.create_task(
            status_of(
                open_keyed_charge(resilient, upstream, clock, "gate=probes", key=f"probe-{n}")
            )
        )
        for n in range(6)
    ]
    await eventually(lambda: upstream.arrivals("probes") == 2)
    await eventually(lambda: sum(task.done() for task in attempts) == 4)

    # Everyone but the probes was refused without reaching the upstream.
    rejected = [task for task in attempts if task.done()]
    for task in rejected:
        assert isinstance(task.exception(), CircuitOpen)
    assert state_of(resilient.breaker) is BreakerState.HALF_OPEN
    upstream.release("probes")
    probes = [task for task in attempts if task not in rejected]
    assert await asyncio.gather(*probes) == [201, 201]
    assert upstream.arrivals("probes") == 2
    assert upstream.total == 2 + 2
    assert state_of(resilient.breaker) is BreakerState.CLOSED


# --------------------------------------------------------------- through the real gateway


def send(
    gateway: RunningGateway,
    method: str = "POST",
    *,
    key: str | None = None,
    behavior: str | None = None,
    headers: dict[str, str] | None = None,
) -> Awaitable[httpx.Response]:
    sent = keyed_headers(key, behavior=behavior, headers=headers)
    body: dict[str, Any] = {"json": {"amount": 1000}} if method in ("POST", "PUT", "PATCH") else {}
    return gateway.client.request(method, CHARGES, headers=sent, **body)


async def record_of(store: RecordStore, key: str) -> Record:
    record = await store.get(RecordKey("anonymous", f"POST {CHARGES}", key))
    assert record is not None
    return record


async def record_status(store: RecordStore, key: str) -> Status:
    return (await record_of(store, key)).status


async def test_503_twice_then_success_is_one_answer_from_three_attempts(
    start_gateway: StartGateway,
    upstream: RecordingUpstream,
    postgres_url: str,
    unique: Callable[[str], str],
    retry_log: Callable[[], list[str]],
) -> None:
    gateway = await start_gateway(postgres_url, retry={**FAST_RETRY, "max_attempts": 3})
    key = unique("503-then-201")

    response = await send(gateway, key=key, behavior="status-first=503,times=2")

    assert response.status_code == 201
    assert response.json()["execution"] == upstream.executions_for(key)[-1].number
    # One record, one owner: every attempt carries the same fencing token.
    assert len({e.fencing_token for e in upstream.executions_for(key)}) == 1
    retries = retries_in(retry_log())
    assert len(retries) == 2
    assert all("primary after status 503" in line for line in retries)
    replay = await send(gateway, key=key)
    assert replay.headers["idempotent-replayed"] == "true"
    assert replay.content == response.content
    assert upstream.count(key) == 3


NOT_IDEMPOTENT = "the request is not idempotent"
MAX_ATTEMPTS = "max_attempts (3) reached"


@pytest.mark.parametrize(
    ("method", "keyed", "status", "attempts", "reason"),
    [
        pytest.param("POST", True, 503, 3, MAX_ATTEMPTS, id="keyed-POST-503"),
        pytest.param("POST", False, 503, 1, NOT_IDEMPOTENT, id="unkeyed-POST-503"),
        pytest.param("PATCH", False, 429, 1, NOT_IDEMPOTENT, id="unkeyed-PATCH-429"),
        pytest.param("GET", False, 503, 3, MAX_ATTEMPTS, id="GET-503"),
        pytest.param("PUT", False, 503, 3, MAX_ATTEMPTS, id="PUT-503"),
        pytest.param("DELETE", False, 429, 3, MAX_ATTEMPTS, id="DELETE-429"),
        pytest.param("POST", True, 500, 1, "500 is not in retry_on", id="keyed-POST-500"),
        pytest.param(
            "POST",
            True,
            502,
            1,
            "502 is ambiguous and the route does not retry ambiguous failures",
            id="keyed-POST-502",
        ),
        pytest.param("GET", False, 502, 3, MAX_ATTEMPTS, id="GET-502-is-safe-to-resend"),
        pytest.param("GET", False, 404, 1, None, id="GET-404"),
    ],
)
async def test_upstream_attempts_for_a_failure_that_never_ends(
    start_gateway: StartGateway,
    upstream: RecordingUpstream,
    postgres_url: str,
    unique: Callable[[str], str],
    retry_log: Callable[[], list[str]],
    method: str,
    keyed: bool,
    status: int,
    attempts: int,
    reason: str | None,
) -> None:
    gateway = await start_gateway(postgres_url, retry={**FAST_RETRY, "max_attempts": 3})
    key = unique("always-failing") if keyed else None

    response = await send(gateway, method, key=key, behavior=f"status={status}")

    assert response.status_code == status
    assert upstream.total == attempts
    assert [e.method for e in upstream.executions] == [method] * attempts
    assert len(retries_in(retry_log())) == attempts - 1
    if reason is not None:
        [final] = final_decisions_in(retry_log())
        assert f"({attempts} attempts): {reason}" in final


async def test_keyed_post_that_ran_out_of_attempts_is_failed_retryable_and_runs_again(
    start_gateway: StartGateway,
    upstream: RecordingUpstream,
    store: RecordStore,
    database_url: str,
    unique: Callable[[str], str],
) -> None:
    gateway = await start_gateway(database_url, retry={**FAST_RETRY, "max_attempts": 3})
    key = unique("exhausted")

    first = await send(gateway, key=key, behavior="status=503")

    assert first.status_code == 503
    assert upstream.count(key) == 3
    assert await record_status(store, key) is Status.FAILED_RETRYABLE
    retry = await send(gateway, key=key)
    assert retry.status_code == 201
    assert "idempotent-replayed" not in retry.headers
    tokens = [e.fencing_token for e in upstream.executions_for(key)]
    # Three attempts of the first owner, then the next owner's larger token.
    assert tokens[:3] == [tokens[0]] * 3
    assert tokens[0] is not None
    assert tokens[3] is not None
    assert tokens[0] < tokens[3]
    assert await record_status(store, key) is Status.SUCCEEDED


async def test_unkeyed_post_to_a_refused_port_is_retried_because_it_never_left(
    start_gateway: StartGateway, postgres_url: str, retry_log: Callable[[], list[str]]
) -> None:
    gateway = await start_gateway(
        postgres_url,
        upstream_url=f"http://127.0.0.1:{free_port()}",
        retry={**FAST_RETRY, "max_attempts": 3},
    )

    response = await send(gateway)

    problem = assert_problem(response, 502, "upstream-unreachable")
    assert problem["retryable"] is True
    log = retry_log()
    retries = retries_in(log)
    assert len(retries) == 2
    assert all("primary after cannot connect" in line for line in retries)
    [final] = final_decisions_in(log)
    assert f"after UpstreamNotSent (3 attempts): {MAX_ATTEMPTS}" in final


# Too short for a 1-second Retry-After pause, long enough for an immediate second attempt.
HALF_SECOND_BUDGET = {"per_try": "500ms", "total": "500ms"}


async def test_429_whose_retry_after_passes_the_deadline_is_answered_at_once(
    start_gateway: StartGateway,
    upstream: RecordingUpstream,
    store: RecordStore,
    database_url: str,
    unique: Callable[[str], str],
    retry_log: Callable[[], list[str]],
) -> None:
    gateway = await start_gateway(database_url, timeouts=HALF_SECOND_BUDGET, retry=FAST_RETRY)
    key = unique("429-late")

    response = await send(gateway, key=key, behavior="status=429,retry-after=1")

    assert response.status_code == 429
    assert response.headers["retry-after"] == "1"
    assert upstream.count(key) == 1
    assert await record_status(store, key) is Status.FAILED_RETRYABLE
    assert count_containing(retry_log(), "a pause of 1.000s would not leave time") == 1


async def test_429_with_retry_after_0_is_retried_at_once(
    start_gateway: StartGateway,
    upstream: RecordingUpstream,
    postgres_url: str,
    unique: Callable[[str], str],
    retry_log: Callable[[], list[str]],
) -> None:
    gateway = await start_gateway(postgres_url, timeouts=HALF_SECOND_BUDGET, retry=FAST_RETRY)
    key = unique("429-now")

    response = await send(gateway, key=key, behavior="status-first=429,retry-after=0")

    assert response.status_code == 201
    assert upstream.count(key) == 2
    assert count_containing(retry_log(), "after status 429: attempt 2 of 3 in 0.000s") == 1


@pytest.mark.parametrize(
    ("behavior", "status", "slug"),
    [
        pytest.param("hang", 504, "upstream-timeout", id="hang-past-per_try"),
        pytest.param("reset", 502, "upstream-connection-lost", id="reset-after-reading-body"),
    ],
)
@pytest.mark.parametrize(
    ("on_ambiguous", "attempts", "record", "reason"),
    [
        pytest.param("fail", 1, Status.FAILED_FINAL, "(ambiguous)", id="fail"),
        pytest.param("retry", 3, Status.FAILED_RETRYABLE, MAX_ATTEMPTS, id="retry"),
    ],
)
async def test_ambiguous_failure_is_retried_only_under_on_ambiguous_retry(
    start_gateway: StartGateway,
    upstream: RecordingUpstream,
    store: RecordStore,
    database_url: str,
    unique: Callable[[str], str],
    retry_log: Callable[[], list[str]],
    behavior: str,
    status: int,
    slug: str,
    on_ambiguous: str,
    attempts: int,
    record: Status,
    reason: str,
) -> None:
    gateway = await start_gateway(
        database_url,
        retry={**FAST_RETRY, "max_attempts": 3},
        timeouts={"per_try": "300ms", "total": "2s"},
        routes=[route("/", on_ambiguous=on_ambiguous)],
    )
    key = unique(f"ambiguous-{behavior}-{on_ambiguous}")

    response = await send(gateway, key=key, behavior=behavior)

    assert_problem(response, status, slug)
    assert upstream.count(key) == attempts
    assert len({e.fencing_token for e in upstream.executions_for(key)}) == 1
    assert len({e.body for e in upstream.executions_for(key)}) == 1
    assert await record_status(store, key) is record
    [final] = final_decisions_in(retry_log())
    assert reason in final


async def test_client_x_request_timeout_shortens_the_deadline_of_every_attempt(
    start_gateway: StartGateway,
    upstream: RecordingUpstream,
    postgres_url: str,
    unique: Callable[[str], str],
    retry_log: Callable[[], list[str]],
) -> None:
    # The route would retry a timeout, and each try could wait 10s: only the client's 0.4s
    # budget ends this request.
    gateway = await start_gateway(
        postgres_url,
        timeouts={"per_try": "10s", "total": "10s"},
        routes=[route("/", on_ambiguous="retry")],
        retry=FAST_RETRY,
    )
    key = unique("client-timeout")

    response = await send(gateway, key=key, behavior="hang", headers={"X-Request-Timeout": "0.4"})

    assert_problem(response, 504, "upstream-timeout")
    [execution] = upstream.executions_for(key)
    forwarded = execution.header_values("X-Request-Timeout")
    assert len(forwarded) == 1
    assert 0 < float(forwarded[0]) <= 0.4
    assert count_containing(retry_log(), "would not leave time for another attempt") == 1


async def test_client_timeout_too_short_for_any_attempt_is_504_and_leaves_the_key_retryable(
    start_gateway: StartGateway,
    upstream: RecordingUpstream,
    store: RecordStore,
    database_url: str,
    unique: Callable[[str], str],
) -> None:
    gateway = await start_gateway(database_url, retry=FAST_RETRY)
    key = unique("no-time")

    response = await send(gateway, key=key, headers={"X-Request-Timeout": "0.001"})

    problem = assert_problem(response, 504, "deadline-exhausted")
    assert problem["retryable"] is True
    assert upstream.count(key) == 0
    assert await record_status(store, key) is Status.FAILED_RETRYABLE
    retry = await send(gateway, key=key)
    assert retry.status_code == 201
    assert upstream.count(key) == 1


async def test_retry_budget_stops_a_retry_storm(
    start_gateway: StartGateway,
    upstream: RecordingUpstream,
    postgres_url: str,
    retry_log: Callable[[], list[str]],
) -> None:
    requests = 200
    gateway = await start_gateway(
        postgres_url,
        retry={**FAST_RETRY, "max_attempts": 3, "budget": {"ratio": 0.1, "min_per_second": 0}},
        # Only the budget may stop these retries: the breaker would reject requests instead.
        breaker={"failure_on": []},
    )

    answers = await asyncio.gather(
        *(send(gateway, "GET", behavior="status=503") for _ in range(requests))
    )

    # The upstream's own 503s, not the gateway's circuit-open problem.
    assert all(answer.status_code == 503 for answer in answers)
    assert all(answer.headers["content-type"] == "application/json" for answer in answers)
    # Without the budget the storm would triple the load to 600 attempts.
    assert requests < upstream.total <= requests + 0.1 * requests
    log = retry_log()
    assert len(retries_in(log)) == upstream.total - requests
    assert count_containing(log, "the retry budget is exhausted") >= requests - 20


async def test_breaker_opens_after_failures_and_then_spares_the_upstream(
    start_gateway: StartGateway,
    upstream: RecordingUpstream,
    store: RecordStore,
    database_url: str,
    unique: Callable[[str], str],
) -> None:
    gateway = await start_gateway(
        database_url,
        breaker={"min_calls": 5, "failure_rate": 0.5, "open_for": "30s"},
        retry=FAST_RETRY,
    )
    breaker = gateway.app.upstreams[PRIMARY].breaker
    for _ in range(5):
        failing = await send(gateway, "GET", behavior="status=500")
        assert failing.status_code == 500
    assert state_of(breaker) is BreakerState.OPEN
    key = unique("breaker-open")

    rejected = await send(gateway, key=key)

    problem = assert_problem(rejected, 503, "circuit-open")
    assert problem["retryable"] is True
    assert 29 <= int(rejected.headers["retry-after"]) <= 30
    assert upstream.total == 5
    assert await record_status(store, key) is Status.FAILED_RETRYABLE

    breaker.force(None)
    refused = await record_of(store, key)
    retry = await send(gateway, key=key)

    assert retry.status_code == 201
    # The refused first owner's token, then the next owner's larger one went upstream.
    [executed] = upstream.executions_for(key)
    assert executed.fencing_token is not None
    assert executed.fencing_token > refused.fencing_token
    assert await record_status(store, key) is Status.SUCCEEDED
