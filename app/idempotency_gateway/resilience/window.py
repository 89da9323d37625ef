"""Time-bucketed counters: the sliding windows of the retry budget and the breaker."""

from __future__ import annotations

from collections import deque

from idempotency_gateway.clock import Monotonic, monotonic

# Buckets per window: fine enough that old events fall out smoothly, few enough to sum fast.
_BUCKETS = 10


class SlidingCounter:
    """How many events happened in the last ``window`` seconds (to 1/10 of the window)."""

    def __init__(self, window: float, *, clock: Monotonic = monotonic) -> None:
        self._clock = clock
        self._width = window / _BUCKETS
        self._buckets: deque[tuple[int, int]] = deque()  # (bucket index, count)

    def _current(self) -> int:
        index = int(self._clock() // self._width)
        while self._buckets and self._buckets[0][0] <= index - _BUCKETS:
            self._buckets.popleft()
        return index

    def add(self, count: int = 1) -> None:
        index = self._current()
        if self._buckets and self._buckets[-1][0] == index:
            self._buckets[-1] = (index, self._buckets[-1][1] + count)
        else:
            self._buckets.append((index, count))

    def total(self) -> int:
        self._current()
        return sum(count for _, count in self._buckets)

    def clear(self) -> None:
        self._buckets.clear()
