"""The building blocks of resilience toward upstreams (contract section 7), on a hand-moved clock.

Full-jitter backoff stays under ``min(cap, base * 2**n)``; ``Retry-After`` parses as seconds or
an HTTP-date and garbage is ignored; the retry budget never lets retries exceed its share of
recent requests (plus its floor) and forgets what left its window; the circuit breaker walks
CLOSED -> OPEN -> HALF_OPEN -> CLOSED | OPEN exactly as configured, ignores outcomes of calls
admitted under an earlier state, and obeys operator overrides. No test sleeps: time is a float
the test moves.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from email.utils import format_datetime

import pytest

from idempotency_gateway.config import BreakerConfig, RetryConfig
from idempotency_gateway.errors import CircuitOpen
from idempotency_gateway.resilience.backoff import full_jitter, parse_retry_after
from idempotency_gateway.resilience.breaker import (
    BreakerSnapshot,
    BreakerState,
    CircuitBreaker,
    Permit,
)
from idempotency_gateway.resilience.budget import RetryBudget
from tests.support.clock import ManualClock, state_of

# --------------------------------------------------------------------------- backoff


@pytest.mark.parametrize("attempt", range(21))
def test_full_jitter_draws_between_zero_and_the_capped_exponential(attempt: int) -> None:
    drawn: list[tuple[float, float]] = []

    def ceiling(low: float, high: float) -> float:
        drawn.append((low, high))
        return high

    delay = full_jitter(attempt, base=0.05, cap=2.0, uniform=ceiling)

    expected = min(2.0, 0.05 * 2**attempt)
    assert drawn == [(0.0, expected)]
    assert delay == expected


def test_full_jitter_with_real_randomness_stays_in_bounds_and_survives_huge_attempts() -> None:
    delays = [full_jitter(3, base=0.1, cap=5.0) for _ in range(200)]
    assert all(0.0 <= delay <= 0.8 for delay in delays)
    assert len(set(delays)) > 1  # jittered, not one synchronised value
    assert 0.0 <= full_jitter(10_000, base=0.1, cap=5.0) <= 5.0


NOW = datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC)


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        pytest.param("0", 0.0, id="zero"),
        pytest.param("120", 120.0, id="delay-seconds"),
        pytest.param(" 7 ", 7.0, id="surrounding-space"),
        pytest.param(format_datetime(NOW + timedelta(seconds=90), usegmt=True), 90.0, id="future"),
        pytest.param(format_datetime(NOW - timedelta(hours=1), usegmt=True), 0.0, id="past"),
        pytest.param("Sun, 01 Mar 2026 12:00:30 -0000", 30.0, id="date-without-zone"),
        pytest.param(None, None, id="absent"),
        pytest.param("", None, id="empty"),
        pytest.param("soon", None, id="word"),
        pytest.param("-5", None, id="negative"),
        pytest.param("1.5", None, id="fraction"),
        pytest.param("\u00b2", None, id="unicode-superscript-digit"),
    ],
)
def test_parse_retry_after(value: str | None, seconds: float | None) -> None:
    assert parse_retry_after(value, now=NOW) == seconds


# ------------------------------------------------------------------------ retry budget


def test_retry_budget_allows_at_most_its_ratio_of_requests(clock: ManualClock) -> None:
    budget = RetryBudget(ratio=0.2, min_per_second=0, window=10.0, clock=clock)
    granted = 0
    for requests in range(1, 1001):
        budget.record_request()
        # Every request asks for a retry, as in an outage: the budget is the only brake.
        if budget.try_withdraw():
            granted += 1
        assert granted <= 0.2 * requests
    assert granted == 200


def test_retry_budget_floor_allows_retries_without_traffic(clock: ManualClock) -> None:
    budget = RetryBudget(ratio=0.2, min_per_second=0.5, window=10.0, clock=clock)

    granted = [budget.try_withdraw() for _ in range(6)]

    assert granted == [True] * 5 + [False]


def test_retry_budget_forgets_requests_and_retries_that_left_the_window(
    clock: ManualClock,
) -> None:
    budget = RetryBudget(ratio=0.5, min_per_second=0, window=10.0, clock=clock)
    for _ in range(10):
        budget.record_request()
    assert [budget.try_withdraw() for _ in range(6)] == [True] * 5 + [False]

    clock.advance(5.0)
    assert not budget.try_withdraw()  # still inside the window: nothing new to spend

    clock.advance(5.0)
    # The traffic that paid for retries is gone: no allowance without new requests.
    assert not budget.try_withdraw()
    for _ in range(4):
        budget.record_request()
    # The old retries are gone too: only the new requests count.
    assert [budget.try_withdraw() for _ in range(3)] == [True, True, False]


# ---------------------------------------------------------------------- circuit breaker

BREAKER = BreakerConfig(
    window=30.0,
    min_calls=4,
    failure_rate=0.5,
    slow_call=2.0,
    slow_call_rate=0.5,
    open_for=10.0,
    half_open_calls=2,
)

Transition = tuple[str, BreakerState, BreakerState]


@pytest.fixture
def transitions() -> list[Transition]:
    return []


@pytest.fixture
def breaker(clock: ManualClock, transitions: list[Transition]) -> CircuitBreaker:
    return CircuitBreaker(
        "payments",
        BREAKER,
        clock=clock,
        on_transition=lambda *change: transitions.append(change),
    )


def call(breaker: CircuitBreaker, *, failure: bool = False) -> None:
    breaker.record(breaker.acquire(), failure=failure)


def calls(breaker: CircuitBreaker, *, failures: int = 0, successes: int = 0) -> None:
    for _ in range(successes):
        call(breaker)
    for _ in range(failures):
        call(breaker, failure=True)


def open_breaker(breaker: CircuitBreaker) -> None:
    calls(breaker, failures=BREAKER.min_calls)
    assert state_of(breaker) is BreakerState.OPEN


def half_open_breaker(breaker: CircuitBreaker, clock: ManualClock) -> None:
    open_breaker(breaker)
    clock.advance(BREAKER.open_for)
    assert state_of(breaker) is BreakerState.HALF_OPEN


def test_breaker_stays_closed_below_min_calls_even_when_every_call_fails(
    breaker: CircuitBreaker,
) -> None:
    calls(breaker, failures=BREAKER.min_calls - 1)

    assert state_of(breaker) is BreakerState.CLOSED
    breaker.acquire()  # still admits


@pytest.mark.parametrize(
    ("successes", "failures", "state"),
    [
        pytest.param(3, 1, BreakerState.CLOSED, id="25%-stays-closed"),
        pytest.param(2, 2, BreakerState.OPEN, id="50%-opens"),
        pytest.param(6, 3, BreakerState.CLOSED, id="33%-of-9-stays-closed"),
    ],
)
def test_breaker_opens_at_the_failure_rate_threshold(
    breaker: CircuitBreaker, successes: int, failures: int, state: BreakerState
) -> None:
    calls(breaker, successes=successes, failures=failures)

    assert breaker.state is state


def test_breaker_counts_only_failures_inside_its_window(
    breaker: CircuitBreaker, clock: ManualClock
) -> None:
    calls(breaker, failures=BREAKER.min_calls - 1)
    clock.advance(BREAKER.window + 1)

    calls(breaker, successes=2, failures=1)

    # 4 failures in total, but only one of the 3 calls in the window failed.
    assert state_of(breaker) is BreakerState.CLOSED
    assert breaker.snapshot().failures == 1


@pytest.mark.parametrize(
    ("duration", "state"),
    [
        pytest.param(BREAKER.slow_call, BreakerState.OPEN, id="at-slow_call"),
        pytest.param(BREAKER.slow_call - 0.01, BreakerState.CLOSED, id="just-under-slow_call"),
    ],
)
def test_breaker_opens_on_the_slow_call_rate(
    breaker: CircuitBreaker, clock: ManualClock, duration: float, state: BreakerState
) -> None:
    calls(breaker, successes=2)
    for _ in range(2):
        permit = breaker.acquire()
        clock.advance(duration)
        breaker.record(permit, failure=False)

    assert breaker.state is state


def test_open_breaker_rejects_with_the_time_left_until_half_open(
    breaker: CircuitBreaker, clock: ManualClock
) -> None:
    open_breaker(breaker)
    clock.advance(2.5)

    with pytest.raises(CircuitOpen) as rejected:
        breaker.acquire()

    assert rejected.value.retry_after == 8  # ceil(10 - 2.5)
    assert (rejected.value.status, rejected.value.slug) == (503, "circuit-open")
    assert rejected.value.retryable is True
    clock.advance(7.4)
    with pytest.raises(CircuitOpen) as almost:
        breaker.acquire()
    assert almost.value.retry_after == 1  # 0.1s left: never "Retry-After: 0"
    assert state_of(breaker) is BreakerState.OPEN


def test_half_open_admits_exactly_half_open_calls_probes(
    breaker: CircuitBreaker, clock: ManualClock
) -> None:
    half_open_breaker(breaker, clock)

    probes = [breaker.acquire() for _ in range(BREAKER.half_open_calls)]

    with pytest.raises(CircuitOpen) as busy:
        breaker.acquire()
    assert busy.value.retry_after == 1
    assert len(probes) == 2
    assert state_of(breaker) is BreakerState.HALF_OPEN


def test_half_open_closes_when_every_probe_succeeds(
    breaker: CircuitBreaker, clock: ManualClock
) -> None:
    half_open_breaker(breaker, clock)
    first, second = (breaker.acquire() for _ in range(2))

    breaker.record(first, failure=False)
    assert state_of(breaker) is BreakerState.HALF_OPEN  # one success is not enough
    breaker.record(second, failure=False)

    assert state_of(breaker) is BreakerState.CLOSED
    # A fresh start: the failures that opened it are forgotten.
    assert breaker.snapshot() == BreakerSnapshot(BreakerState.CLOSED, 0, 0, 0)
    calls(breaker, failures=BREAKER.min_calls - 1)
    assert state_of(breaker) is BreakerState.CLOSED


@pytest.mark.parametrize("slow", [False, True], ids=["failed-probe", "slow-probe"])
def test_half_open_reopens_when_a_probe_fails(
    breaker: CircuitBreaker, clock: ManualClock, slow: bool
) -> None:
    half_open_breaker(breaker, clock)
    good, bad = (breaker.acquire() for _ in range(2))
    breaker.record(good, failure=False)

    if slow:
        clock.advance(BREAKER.slow_call)
    breaker.record(bad, failure=not slow)

    assert state_of(breaker) is BreakerState.OPEN
    with pytest.raises(CircuitOpen) as rejected:
        breaker.acquire()
    assert rejected.value.retry_after == 10  # a full open_for from the failed probe


def test_outcome_of_a_call_admitted_before_a_transition_is_ignored(
    breaker: CircuitBreaker, clock: ManualClock
) -> None:
    stale_failure = breaker.acquire()
    stale_success = breaker.acquire()
    half_open_breaker(breaker, clock)
    probe = breaker.acquire()

    # Admitted while CLOSED: neither reopens the half-open breaker nor counts as a probe.
    breaker.record(stale_failure, failure=True)
    assert state_of(breaker) is BreakerState.HALF_OPEN
    breaker.record(stale_success, failure=False)
    breaker.record(probe, failure=False)
    assert state_of(breaker) is BreakerState.HALF_OPEN

    breaker.record(breaker.acquire(), failure=False)
    assert state_of(breaker) is BreakerState.CLOSED


def test_a_permit_from_another_generation_is_ignored_while_closed(
    breaker: CircuitBreaker,
) -> None:
    for _ in range(BREAKER.min_calls):
        breaker.record(Permit(generation=99, started_at=0.0), failure=True)

    assert state_of(breaker) is BreakerState.CLOSED
    assert breaker.snapshot().calls == 0


def test_forced_open_rejects_everything(breaker: CircuitBreaker) -> None:
    breaker.force(BreakerState.FORCED_OPEN)

    for _ in range(3):
        with pytest.raises(CircuitOpen) as rejected:
            breaker.acquire()
        assert rejected.value.retry_after == 10
    assert state_of(breaker) is BreakerState.FORCED_OPEN


@pytest.mark.parametrize("override", [BreakerState.FORCED_CLOSED, BreakerState.DISABLED])
def test_forced_closed_and_disabled_admit_everything_despite_failures(
    breaker: CircuitBreaker, clock: ManualClock, override: BreakerState
) -> None:
    open_breaker(breaker)
    breaker.force(override)

    for _ in range(3 * BREAKER.min_calls):
        call(breaker, failure=True)
        clock.advance(BREAKER.open_for)

    assert breaker.state is override
    assert breaker.snapshot().failures == 0


def test_force_none_returns_to_closed_and_only_overrides_can_be_forced(
    breaker: CircuitBreaker,
) -> None:
    breaker.force(BreakerState.FORCED_OPEN)
    breaker.force(None)

    assert state_of(breaker) is BreakerState.CLOSED
    breaker.acquire()
    for state in (BreakerState.OPEN, BreakerState.HALF_OPEN, BreakerState.CLOSED):
        with pytest.raises(ValueError, match="can only force"):
            breaker.force(state)
    assert state_of(breaker) is BreakerState.CLOSED


def test_force_none_closes_an_open_breaker(breaker: CircuitBreaker) -> None:
    open_breaker(breaker)

    breaker.force(None)

    assert state_of(breaker) is BreakerState.CLOSED
    breaker.acquire()


def test_transition_listener_sees_every_transition_in_order(
    breaker: CircuitBreaker, clock: ManualClock, transitions: list[Transition]
) -> None:
    half_open_breaker(breaker, clock)
    call(breaker, failure=True)  # probe fails: back to OPEN
    clock.advance(BREAKER.open_for)
    calls(breaker, successes=BREAKER.half_open_calls)  # HALF_OPEN, then CLOSED
    breaker.force(BreakerState.FORCED_OPEN)
    breaker.force(BreakerState.DISABLED)
    breaker.force(None)

    s = BreakerState
    assert transitions == [
        ("payments", s.CLOSED, s.OPEN),
        ("payments", s.OPEN, s.HALF_OPEN),
        ("payments", s.HALF_OPEN, s.OPEN),
        ("payments", s.OPEN, s.HALF_OPEN),
        ("payments", s.HALF_OPEN, s.CLOSED),
        ("payments", s.CLOSED, s.FORCED_OPEN),
        ("payments", s.FORCED_OPEN, s.DISABLED),
        ("payments", s.DISABLED, s.CLOSED),
    ]


# ------------------------------------------------------------------------------ config


@pytest.mark.parametrize("status", [400, 404, 409, 422])
def test_retry_config_refuses_to_retry_a_plain_4xx(status: int) -> None:
    with pytest.raises(ValueError, match=f"{status} cannot be retried"):
        RetryConfig(retry_on=frozenset({status}))


def test_retry_config_accepts_the_not_processed_statuses() -> None:
    config = RetryConfig(retry_on=frozenset({"connect-failure", 408, 425, 429, 502, 503}))

    assert config.retry_statuses == frozenset({408, 425, 429, 502, 503})
