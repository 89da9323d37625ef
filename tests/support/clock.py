"""The one hand-moved clock of the suite: leases, TTLs, breakers, budgets, deadlines and retry
pauses all move when the test says so, and nothing really waits.

    clock = ManualClock()
    store = open_store(url, config, clock=clock.utc)       # utc() -> datetime
    breaker = CircuitBreaker("u", config, clock=clock)               # clock() -> seconds
    upstream = ResilientUpstream(client, clock=clock, sleep=clock.sleep, uniform=clock.uniform)
    clock.advance(30)                                                # both readings move

The code under test reads time two ways: a store's "now" is a UTC ``datetime``, the resilience
layer's is a float of seconds. One object serves both, moved together by ``advance`` and
``sleep``, so a test never keeps two clocks in step by hand. ``now`` may also be set outright
(a record written long ago) without moving the seconds.

``sleep`` records each requested pause and moves the clock by it, then runs ``on_sleep`` (if
set), so a test can do something "during" the pause, such as releasing an upstream gate.
``uniform`` records its bounds and returns the upper one, making full jitter predictable.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

from idempotency_gateway.resilience.breaker import BreakerState, CircuitBreaker

START = datetime(2026, 1, 1, tzinfo=UTC)
# Far from zero, so a "now minus window" never goes negative; small, so float sums of the
# pauses the tests assert stay exact.
START_SECONDS = 1000.0


class ManualClock:
    def __init__(self, now: datetime = START, seconds: float = START_SECONDS) -> None:
        self.now = now
        """What ``utc()`` answers: the store's time."""
        self.seconds = seconds
        """What calling the clock answers: the resilience layer's time."""
        self.sleeps: list[float] = []
        """Every pause requested through ``sleep``, in order."""
        self.jitter_bounds: list[tuple[float, float]] = []
        """Every ``(low, high)`` passed to ``uniform``, in order."""
        self.on_sleep: Callable[[float], Awaitable[None]] | None = None

    def __call__(self) -> float:
        return self.seconds

    def utc(self) -> datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.seconds += seconds
        self.now += timedelta(seconds=seconds)

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.advance(seconds)
        if self.on_sleep is not None:
            await self.on_sleep(seconds)

    def uniform(self, low: float, high: float) -> float:
        self.jitter_bounds.append((low, high))
        return high


def state_of(breaker: CircuitBreaker) -> BreakerState:
    """The state read afresh: it moves with the clock and with probes between two asserts,
    which a plain ``breaker.state`` comparison would let mypy narrow away."""
    return breaker.state


LIBFAKETIME = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1")


def skewed_clock_env(skew: timedelta) -> dict[str, str]:
    """Environment for a gateway process whose host's wall clock is off by ``skew`` (ahead
    when positive), under libfaketime, which ``scripts/test`` installs. Only the wall clock is
    skewed: timers, timeouts and the monotonic clock keep running at the real pace."""
    assert LIBFAKETIME.exists(), "libfaketime is missing: run scripts/test, which installs it"
    return {
        "LD_PRELOAD": str(LIBFAKETIME),
        "FAKETIME": f"{int(skew.total_seconds()):+d}s",
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",
    }
