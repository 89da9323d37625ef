"""A circuit breaker per upstream: time-window failure and slow-call rates.

    CLOSED --(>= min_calls in the window and failure or slow-call rate over threshold)--> OPEN
    OPEN --(open_for elapsed)--> HALF_OPEN: admits half_open_calls probes
    HALF_OPEN --(every probe succeeded)--> CLOSED;  --(a probe failed)--> OPEN

Operators may pin the breaker: FORCED_OPEN rejects everything, FORCED_CLOSED and DISABLED
admit everything (DISABLED also stops counting). Outcomes of calls admitted under an earlier
state are ignored, so a slow call that started before the breaker opened cannot close it.

Callers use ``with breaker.trial() as trial: ...; trial.settle(failure=...)``: leaving the
block without a verdict (cancelled, or an exception that says nothing about the upstream)
hands a half-open permit back, so no lost call can keep a breaker refusing for good.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from types import TracebackType
from typing import Self

from idempotency_gateway.clock import Monotonic, monotonic
from idempotency_gateway.config import BreakerConfig
from idempotency_gateway.errors import CircuitOpen
from idempotency_gateway.resilience.window import SlidingCounter

# A full HALF_OPEN breaker asks callers to come back soon: a probe finishes quickly.
_HALF_OPEN_BUSY_RETRY_AFTER = 1.0


class BreakerState(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"
    FORCED_OPEN = "forced_open"
    FORCED_CLOSED = "forced_closed"
    DISABLED = "disabled"


OVERRIDES = frozenset({BreakerState.FORCED_OPEN, BreakerState.FORCED_CLOSED, BreakerState.DISABLED})

TransitionListener = Callable[[str, BreakerState, BreakerState], None]


@dataclass(frozen=True, slots=True)
class BreakerSnapshot:
    state: BreakerState
    calls: int
    failures: int
    slow_calls: int


@dataclass(frozen=True, slots=True)
class Permit:
    generation: int
    started_at: float


class Trial:
    """One admitted call, settled exactly once: by ``settle`` or, failing that, on leaving
    the ``with`` block, where the permit goes back without a verdict."""

    __slots__ = ("_breaker", "_permit", "settled")

    def __init__(self, breaker: CircuitBreaker, permit: Permit) -> None:
        self._breaker = breaker
        self._permit = permit
        self.settled = False

    def settle(self, *, failure: bool) -> None:
        """The upstream's verdict on this call; only the first one counts."""
        if not self.settled:
            self.settled = True
            self._breaker.record(self._permit, failure=failure)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if not self.settled:
            self.settled = True
            self._breaker.release(self._permit)


class CircuitBreaker:
    """Admission control for one upstream: stops calling it while it is failing.

    ``trial()`` admits one call or raises ``CircuitOpen`` (with a Retry-After hint). The
    call's verdict (``Trial.settle``) feeds time-windowed failure and slow-call rates; over
    either threshold the breaker opens for ``open_for`` seconds, then lets ``half_open_calls``
    probes through and closes when all of them succeed. A call that ends without a verdict
    (cancelled by a client that went away, or a bug of ours) is neither success nor failure:
    its permit is returned so the next caller can probe. Operators can pin the state through
    ``force`` (the admin API's overrides). Not thread-safe: one breaker per event loop.

    Arguments:
        name: the upstream's name, for errors, logs and ``on_transition``.
        config: thresholds and timings (``BreakerConfig``).
        clock: monotonic seconds; tests pass a clock they move by hand.
        on_transition: called with (name, old state, new state) on every state change.
    """

    def __init__(
        self,
        name: str,
        config: BreakerConfig,
        *,
        clock: Monotonic = monotonic,
        on_transition: TransitionListener | None = None,
    ) -> None:
        self.name = name
        self.config = config
        self._clock = clock
        self._on_transition = on_transition
        self._state = BreakerState.CLOSED
        self._generation = 0
        self._opened_at = 0.0
        self._probes_admitted = 0
        self._probes_succeeded = 0
        self._calls = SlidingCounter(config.window, clock=clock)
        self._failures = SlidingCounter(config.window, clock=clock)
        self._slow = SlidingCounter(config.window, clock=clock)

    @property
    def state(self) -> BreakerState:
        if self._state is BreakerState.OPEN and self._open_time_left() <= 0:
            self._move_to(BreakerState.HALF_OPEN)
        return self._state

    def _open_time_left(self) -> float:
        return self._opened_at + self.config.open_for - self._clock()

    def trial(self) -> Trial:
        """Admission for one call, to use as ``with``; raises ``CircuitOpen`` when refused."""
        return Trial(self, self.acquire())

    def acquire(self) -> Permit:
        """Admission for one attempt; raises ``CircuitOpen`` when the breaker says no.

        Every permit must end in ``record`` or ``release``: prefer ``trial()``, which
        guarantees it."""
        state = self.state
        if state is BreakerState.FORCED_OPEN:
            raise CircuitOpen(self.name, retry_after=self.config.open_for)
        if state is BreakerState.OPEN:
            raise CircuitOpen(self.name, retry_after=self._open_time_left())
        if state is BreakerState.HALF_OPEN:
            if self._probes_admitted >= self.config.half_open_calls:
                raise CircuitOpen(self.name, retry_after=_HALF_OPEN_BUSY_RETRY_AFTER)
            self._probes_admitted += 1
        return Permit(self._generation, self._clock())

    def record(self, permit: Permit, *, failure: bool) -> None:
        """The outcome of an admitted attempt."""
        if permit.generation != self._generation or self._state in OVERRIDES:
            return
        slow = self._clock() - permit.started_at >= self.config.slow_call
        if self._state is BreakerState.HALF_OPEN:
            self._record_probe(failed=failure or slow)
            return
        self._calls.add()
        if failure:
            self._failures.add()
        if slow:
            self._slow.add()
        # Only a failed or slow call can tip a rate over its threshold: a good one lowers
        # both, so it skips summing the windows (the cache's guard pays this per request).
        if (failure or slow) and self._should_open():
            self._move_to(BreakerState.OPEN)

    def release(self, permit: Permit) -> None:
        """Hand back a permit whose call ended without a verdict on the upstream."""
        if permit.generation == self._generation and self._state is BreakerState.HALF_OPEN:
            self._probes_admitted -= 1

    def _record_probe(self, *, failed: bool) -> None:
        if failed:
            self._move_to(BreakerState.OPEN)
            return
        self._probes_succeeded += 1
        if self._probes_succeeded >= self.config.half_open_calls:
            self._move_to(BreakerState.CLOSED)

    def _should_open(self) -> bool:
        calls = self._calls.total()
        if calls < self.config.min_calls:
            return False
        return (
            self._failures.total() / calls >= self.config.failure_rate
            or self._slow.total() / calls >= self.config.slow_call_rate
        )

    def force(self, state: BreakerState | None) -> None:
        """Pin the breaker to an override state, or ``None`` to return to normal (CLOSED)."""
        if state is not None and state not in OVERRIDES:
            raise ValueError(f"can only force {', '.join(sorted(OVERRIDES))}")
        self._move_to(state or BreakerState.CLOSED)

    def _move_to(self, new: BreakerState) -> None:
        old = self._state
        self._state = new
        self._generation += 1
        self._probes_admitted = 0
        self._probes_succeeded = 0
        if new is BreakerState.OPEN:
            self._opened_at = self._clock()
        if new in (BreakerState.CLOSED, BreakerState.HALF_OPEN):
            # A fresh start: the failures that opened the breaker must not reopen it.
            self._calls.clear()
            self._failures.clear()
            self._slow.clear()
        if old is not new and self._on_transition is not None:
            self._on_transition(self.name, old, new)

    def snapshot(self) -> BreakerSnapshot:
        return BreakerSnapshot(
            self.state, self._calls.total(), self._failures.total(), self._slow.total()
        )
