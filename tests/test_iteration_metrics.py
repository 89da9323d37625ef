"""Request metrics are written once per loop iteration, and say what writing each one would.

With multiprocess values (as ``serve`` runs) a scrape sees the sums of every iteration that
ended before it; the samples equal those of a histogram and a counter that observed each
value on its own (property-tested over values on, between and beyond the bucket bounds); with
no loop running, a value is written at once. With in-memory values (library mode) every value
is written at once, so a reader in another thread never sees a request late.
"""

from __future__ import annotations

import asyncio
import math
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Histogram

from idempotency_gateway.telemetry import iteration_metrics
from idempotency_gateway.telemetry.iteration_metrics import CountOnce, counts, observations

BUCKETS = (0.001, 0.01, 0.1, 1.0)


@contextmanager
def as_in_a_serve_worker() -> Iterator[None]:
    """Batched, as with the multiprocess values every ``serve`` worker has (this test
    process's values are in memory)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(iteration_metrics, "BATCHED", True)
        yield


@pytest.fixture
def batched() -> Iterator[None]:
    with as_in_a_serve_worker():
        yield


def samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in registry.collect()
        for sample in family.samples
    }


def metric_pair(
    registry: CollectorRegistry,
) -> tuple[Counter, Histogram]:
    counter = Counter("requests_total", "requests", ["route"], registry=registry)
    histogram = Histogram(
        "request_seconds", "durations", ["route"], buckets=BUCKETS, registry=registry
    )
    return counter, histogram


async def iteration_end() -> None:
    """Done once the callbacks the current iteration scheduled have run."""
    done = asyncio.get_running_loop().create_future()
    asyncio.get_running_loop().call_soon(done.set_result, None)
    await done


@pytest.mark.usefixtures("batched")
async def test_an_iterations_values_are_written_after_it_not_before() -> None:
    registry = CollectorRegistry()
    counter, histogram = metric_pair(registry)
    count = counts(counter)("charges")
    observe = observations(histogram)("charges")

    for _ in range(32):
        count.inc()
        observe.observe(0.005)
    before = samples(registry)
    await iteration_end()
    after = samples(registry)

    route = (("route", "charges"),)
    assert before[("requests_total", route)] == 0
    assert before[("request_seconds_count", route)] == 0
    assert after[("requests_total", route)] == 32
    assert after[("request_seconds_count", route)] == 32
    assert after[("request_seconds_bucket", (("le", "0.01"), *route))] == 32
    assert after[("request_seconds_bucket", (("le", "0.001"), *route))] == 0


@pytest.mark.usefixtures("batched")
async def test_each_series_is_written_once_per_iteration(monkeypatch: pytest.MonkeyPatch) -> None:
    registry = CollectorRegistry()
    _, histogram = metric_pair(registry)
    child = histogram.labels("charges")
    writes: list[float] = []
    for part in (child._sum, *child._buckets):
        original = part.inc

        def counted(amount: float, *, original: Any = original) -> None:
            writes.append(amount)
            original(amount)

        monkeypatch.setattr(part, "inc", counted)

    observe = observations(histogram)("charges")
    for value in (0.0005, 0.005, 0.005, 0.05, 5.0):
        observe.observe(value)
    await iteration_end()

    # The sum, then one write per bucket the values fell in (four buckets, five values).
    assert len(writes) == 1 + 4
    assert math.isclose(writes[0], 0.0605 + 5.0)


def test_without_a_running_loop_a_value_is_written_at_once() -> None:
    registry = CollectorRegistry()
    counter, histogram = metric_pair(registry)
    counts(counter)("admin").inc(2)
    observations(histogram)("admin").observe(0.5)
    written = samples(registry)
    assert written[("requests_total", (("route", "admin"),))] == 2
    assert written[("request_seconds_sum", (("route", "admin"),))] == 0.5


values = st.lists(
    st.one_of(
        st.sampled_from([0.0, *BUCKETS, -1.0, 1e9, math.inf]),
        st.floats(min_value=-10, max_value=10, allow_nan=False),
    ),
    min_size=1,
    max_size=40,
)


@given(values=values)
def test_written_together_the_samples_equal_observing_each_value_alone(values: list[float]) -> None:
    alone, together = CollectorRegistry(), CollectorRegistry()
    counter_alone, histogram_alone = metric_pair(alone)
    counter_together, histogram_together = metric_pair(together)
    for value in values:
        histogram_alone.labels("r").observe(value)
        counter_alone.labels("r").inc()

    async def in_one_iteration() -> None:
        count, observe = counts(counter_together)("r"), observations(histogram_together)("r")
        for value in values:
            observe.observe(value)
            count.inc()
        await iteration_end()

    with as_in_a_serve_worker():
        asyncio.run(in_one_iteration())

    expected, got = samples(alone), samples(together)
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        assert math.isclose(got[name], value, rel_tol=1e-9, abs_tol=1e-9), name


@pytest.mark.usefixtures("batched")
def test_sums_left_by_a_loop_that_closed_first_are_written_by_the_next_one() -> None:
    registry = CollectorRegistry()
    counter, _ = metric_pair(registry)
    count = counts(counter)("charges")

    abandoned = asyncio.new_event_loop()
    abandoned.call_soon(count.inc)  # its write is due on the next iteration
    abandoned.call_soon(abandoned.stop)  # which never comes
    abandoned.run_forever()
    abandoned.close()
    assert samples(registry)[("requests_total", (("route", "charges"),))] == 0

    async def count_again() -> None:
        count.inc()
        await iteration_end()

    asyncio.run(count_again())
    assert samples(registry)[("requests_total", (("route", "charges"),))] == 2


async def test_with_in_memory_values_a_value_is_written_at_once_even_in_a_loop() -> None:
    assert iteration_metrics.BATCHED is False  # this process has no multiprocess directory
    registry = CollectorRegistry()
    counter, histogram = metric_pair(registry)
    counts(counter)("charges").inc()
    observations(histogram)("charges").observe(0.005)
    written = samples(registry)
    assert written[("requests_total", (("route", "charges"),))] == 1
    assert written[("request_seconds_count", (("route", "charges"),))] == 1


@pytest.mark.parametrize("multiprocess", [True, False])
def test_writes_are_batched_exactly_when_values_are_multiprocess(
    multiprocess: bool, tmp_path: Path
) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    if multiprocess:
        env["PROMETHEUS_MULTIPROC_DIR"] = str(tmp_path)
    code = "from idempotency_gateway.telemetry import iteration_metrics as m; print(m.BATCHED)"
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == str(multiprocess)
    # Importing it writes no series of its own into the workers' metric files.
    assert list(tmp_path.iterdir()) == []


def count_then_fork(registry: CollectorRegistry, in_child: Callable[[CountOnce], None]) -> float:
    """Count once in a running loop, fork before the iteration ends, run ``in_child`` in the
    child; returns the child's count of the series, then the parent writes its own."""
    count = counts(metric_pair(registry)[0])("charges")
    read_end, write_end = os.pipe()

    async def count_and_fork() -> int:
        count.inc()  # the parent's, pending until this iteration ends
        child = os.fork()
        if child == 0:  # pragma: no cover - the child reports through the pipe
            try:
                in_child(count)
                written = samples(registry)[("requests_total", (("route", "charges"),))]
                os.write(write_end, str(written).encode())
            finally:
                os._exit(0)
        await iteration_end()
        return child

    child = asyncio.run(count_and_fork())
    os.close(write_end)
    reported = os.read(read_end, 64).decode()
    os.close(read_end)
    os.waitpid(child, 0)
    return float(reported)


@pytest.mark.usefixtures("batched")
def test_a_forked_child_does_not_write_its_parents_sums_again() -> None:
    registry = CollectorRegistry()

    def write(_: CountOnce) -> None:
        iteration_metrics.write_pending()

    assert count_then_fork(registry, write) == 0
    assert samples(registry)[("requests_total", (("route", "charges"),))] == 1


@pytest.mark.usefixtures("batched")
def test_a_child_forked_in_a_running_loop_writes_every_value_of_its_own() -> None:
    """Forked mid-iteration, the child inherits its parent's sums and the parent's loop, which
    never runs again there; what the child counts in a loop of its own and with no loop is
    written, and the parent's sum is not."""
    registry = CollectorRegistry()

    def count_on(count: CountOnce) -> None:
        async def serve() -> None:
            for _ in range(3):
                count.inc()
                await iteration_end()

        asyncio.run(serve())
        count.inc()  # no loop running: written at once

    assert count_then_fork(registry, count_on) == 4
    assert samples(registry)[("requests_total", (("route", "charges"),))] == 1
