"""Time the test moves by hand, for code that takes ``clock=``, ``sleep=`` and ``uniform=``.

    time = FakeTime()
    breaker = CircuitBreaker("u", config, clock=time)              # time() -> seconds
    upstream = ResilientUpstream(client, clock=time, sleep=time.sleep, uniform=time.uniform)
    time.advance(30)                                                # nothing really waits

``sleep`` records each requested pause and moves the clock by it, then runs ``on_sleep`` (if
set), so a test can do something "during" the pause, such as releasing an upstream gate.
``uniform`` records its bounds and returns the upper one, making full jitter predictable.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable


class FakeTime:
    def __init__(self, start: float = 1000.0) -> None:
        self.now = start
        self.sleeps: list[float] = []
        """Every pause requested through ``sleep``, in order."""
        self.jitter_bounds: list[tuple[float, float]] = []
        """Every ``(low, high)`` passed to ``uniform``, in order."""
        self.on_sleep: Callable[[float], Awaitable[None]] | None = None

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds
        if self.on_sleep is not None:
            await self.on_sleep(seconds)

    def uniform(self, low: float, high: float) -> float:
        self.jitter_bounds.append((low, high))
        return high
