"""Request metrics written once per event loop iteration instead of once per request.

With ``PROMETHEUS_MULTIPROC_DIR`` set (``serve`` always sets it) every counter increment and
histogram observation is a locked write into a memory-mapped file, with a process id check:
a proxied request made six of them, about a tenth of its CPU in the worker
(``benchmarks/RESULTS.md``, "Metrics and the access line"). Here a request only adds to a
sum kept in this thread; the sums are written after the loop iteration's other callbacks ran
(``loop.call_soon``), one write per series however many requests the iteration served. A
histogram's observations are written as one addition to its sum and one to each bucket they
fell in, which is what observing them one by one would have written.

Nothing waits for a timer: a scrape served by the same loop arrives in a later iteration and
sees every request that ended before it; a reader in another thread or process may see a
request one iteration late. With no event loop running in the thread, a value is written at
once, and so it is without multiprocess values (library mode, one process): there a write is
an addition under a lock, too cheap to be worth that lateness.
Only bounded series pass through here (``Children`` of the families in ``metrics``).
"""

from __future__ import annotations

import asyncio
import bisect
import os
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

from prometheus_client import Counter, Histogram
from prometheus_client import values as prometheus_values

M = TypeVar("M", Counter, Histogram)


class _Pending(threading.local):
    """This thread's sums since its loop's last write; a dict keeps first-seen order."""

    def __init__(self) -> None:
        self.forget()

    def forget(self) -> None:
        self.counts: dict[Counter, float] = {}
        self.observations: dict[Histogram, list[float]] = {}
        # The loop a write is due on: one that closed before running it leaves the sums to
        # the next loop of this thread, which schedules a write of its own.
        self.due_on: asyncio.AbstractEventLoop | None = None
        # A forked child inherits its parent's sums, which the parent writes itself.
        self.pid = os.getpid()


_pending = _Pending()

# prometheus-client chose its values when it was imported: memory-mapped files only when
# ``PROMETHEUS_MULTIPROC_DIR`` was set.
BATCHED = prometheus_values.ValueClass is not prometheus_values.MutexValue


def _forget_a_parents_sums() -> None:
    """In a forked child, drop the sums it inherited: they are its parent's to write."""
    if _pending.pid != os.getpid():
        _pending.forget()


def _schedule() -> bool:
    """Whether a write at the end of this iteration is (now) due; False without a loop, or
    without multiprocess values."""
    if not BATCHED:
        return False
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return False
    if _pending.due_on is not loop:
        # A forked child's first write: the values it adds from now on are its own.
        _forget_a_parents_sums()
        loop.call_soon(write_pending)
        _pending.due_on = loop
    return True


def write_pending() -> None:
    """Write this thread's sums into the metrics (their files, when multiprocess)."""
    _pending.due_on = None
    _forget_a_parents_sums()  # a write the parent queued, run in a child forked before it
    counts, _pending.counts = _pending.counts, {}
    observations, _pending.observations = _pending.observations, {}
    for counter, amount in counts.items():
        counter.inc(amount)
    for histogram, values in observations.items():
        _observe_all(histogram, values)


def _observe_all(histogram: Histogram, values: list[float]) -> None:
    if len(values) > 1:
        try:
            # The parts ``Histogram.observe`` itself writes: the sum, and the first bucket
            # whose upper bound the value does not exceed (the exposition accumulates them).
            bounds: list[float] = histogram._upper_bounds
            buckets = histogram._buckets
            total = histogram._sum
        except AttributeError:
            pass  # a prometheus-client that keeps them elsewhere: one by one, as before
        else:
            total.inc(sum(values))
            per_bucket: dict[int, int] = {}
            for value in values:
                index = bisect.bisect_left(bounds, value)
                if index < len(bounds) and value <= bounds[index]:  # never true of NaN, as there
                    per_bucket[index] = per_bucket.get(index, 0) + 1
            for index, count in per_bucket.items():
                buckets[index].inc(count)
            return
    for value in values:
        histogram.observe(value)


class CountOnce:
    """A counter's labelled child, incremented at the end of the iteration."""

    __slots__ = ("counter",)

    def __init__(self, counter: Counter) -> None:
        self.counter = counter

    def inc(self, amount: float = 1.0) -> None:
        if not _schedule():
            self.counter.inc(amount)
            return
        counts = _pending.counts
        counts[self.counter] = counts.get(self.counter, 0.0) + amount


class ObserveOnce:
    """A histogram's labelled child, observed at the end of the iteration."""

    __slots__ = ("histogram",)

    def __init__(self, histogram: Histogram) -> None:
        self.histogram = histogram

    def observe(self, value: float) -> None:
        if not _schedule():
            self.histogram.observe(value)
            return
        values = _pending.observations.get(self.histogram)
        if values is None:
            _pending.observations[self.histogram] = [value]
        else:
            values.append(value)


C = TypeVar("C", CountOnce, ObserveOnce)


class Children(Generic[M, C]):
    """``metric.labels(*values)`` looked up once per label combination, not per request.

    Safe to keep forever only because every label here is bounded (config names, enums).
    """

    def __init__(self, metric: M, wrap: Callable[[M], C]) -> None:
        self._metric: M = metric
        self._wrap: Callable[[M], C] = wrap
        self._children: dict[tuple[str, ...], C] = {}

    def __call__(self, *values: str) -> C:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self._wrap(self._metric.labels(*values))
        return child


def counts(counter: Counter) -> Children[Counter, CountOnce]:
    return Children(counter, CountOnce)


def observations(histogram: Histogram) -> Children[Histogram, ObserveOnce]:
    return Children(histogram, ObserveOnce)
