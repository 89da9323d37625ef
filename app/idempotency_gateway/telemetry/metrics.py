"""Prometheus metrics, prefix ``idempotency_gateway_``.

With ``serve --workers N`` every worker writes its samples to ``PROMETHEUS_MULTIPROC_DIR`` and
a scrape of any worker reads them all, so ``/metrics`` shows the sum over workers (the CLI sets
the directory up before the workers start). Labels are bounded: route and upstream names from
the config, operation names and outcome words, never paths, keys or credentials.

Gauges use a ``live*`` multiprocess mode: the supervisor drops a dead worker's gauge files
(``multiprocess.DeadWorkerReaper``), so a gauge never speaks for a process that is gone.

``serve`` runs every worker this way, one or many, so a scrape shows the same families
whatever the worker count: no ``_created`` series, every family declared here present before
its first sample, and a ``pid`` label only on the per-worker ``process_*`` families.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
from collections.abc import Iterable, Iterator

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from idempotency_gateway.telemetry.multiprocess import MULTIPROCESS_ENV, live_worker_pids
from idempotency_gateway.telemetry.worker_processes import WorkerProcessCollector

PREFIX = "idempotency_gateway_"

# A ``_created`` series per child doubles the series count and means nothing to the alerts;
# multiprocess scrapes never have them, so a single process must not either.
disable_created_metrics()  # type: ignore[no-untyped-call]

# Proxy latencies: sub-millisecond replays up to the 30 s default deadline.
_REQUEST_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
)
# Store and cache statements: fractions of a millisecond to the 2 s statement timeout.
_STORAGE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 2)

REQUESTS = Counter(
    PREFIX + "requests_total",
    "Requests by route, idempotency outcome and response status class (2xx, 4xx, ...)",
    ["route", "outcome", "status_class"],
)
REQUEST_DURATION = Histogram(
    PREFIX + "request_duration_seconds",
    "Time from request to the end of the response, by route and outcome",
    ["route", "outcome"],
    buckets=_REQUEST_BUCKETS,
)
UPSTREAM_ATTEMPTS = Counter(
    PREFIX + "upstream_attempts_total",
    "Attempts sent to upstreams, by result (status class or failure kind)",
    ["upstream", "result"],
)
UPSTREAM_ATTEMPT_DURATION = Histogram(
    PREFIX + "upstream_attempt_duration_seconds",
    "Time until an upstream answered with a response head (or failed)",
    ["upstream"],
    buckets=_REQUEST_BUCKETS,
)
UPSTREAM_RETRIES = Counter(
    PREFIX + "upstream_retries_total",
    "Retries the gateway made, by upstream",
    ["upstream"],
)
RETRY_BUDGET_EXHAUSTED = Counter(
    PREFIX + "retry_budget_exhausted_total",
    "Retries refused because the upstream's retry budget was empty",
    ["upstream"],
)
BREAKER_STATE = Gauge(
    PREFIX + "breaker_state",
    "Circuit breaker state: 0 closed, 1 half_open, 2 open, 3 forced_open, "
    "4 forced_closed, 5 disabled (worst over live workers)",
    ["upstream"],
    # The worst state any live worker sees is what an operator must know; a dead worker's
    # "forced open" must not outlive it (it would keep BreakerForced firing forever).
    multiprocess_mode="livemax",
)
BREAKER_TRANSITIONS = Counter(
    PREFIX + "breaker_transitions_total",
    "Circuit breaker state changes",
    ["upstream", "from_state", "to_state"],
)
# Bulkheads: ``kind`` is ``tier`` (a route tier of the config's ``bulkheads``) or ``upstream``;
# ``name`` is the tier's or the upstream's name. Each worker has its own bulkheads, so the
# gauges (limits included) add up over live workers.
BULKHEAD_IN_FLIGHT = Gauge(
    PREFIX + "bulkhead_in_flight",
    "Requests holding a slot of a bulkhead (retries included), sampled every second, "
    "summed over live workers",
    ["kind", "name"],
    multiprocess_mode="livesum",
)
BULKHEAD_QUEUED = Gauge(
    PREFIX + "bulkhead_queued",
    "Requests waiting in a bulkhead's queue for a slot, sampled every second, summed over "
    "live workers",
    ["kind", "name"],
    multiprocess_mode="livesum",
)
BULKHEAD_LIMIT = Gauge(
    PREFIX + "bulkhead_max_concurrent",
    "A bulkhead's max_concurrent, summed over live workers (the capacity in_flight fills)",
    ["kind", "name"],
    multiprocess_mode="livesum",
)
BULKHEAD_REFUSALS = Counter(
    PREFIX + "bulkhead_refusals_total",
    "Requests refused with capacity-exhausted (queue_full, queue_timeout) and retries not "
    "made (retry_no_slot), by bulkhead",
    ["kind", "name", "reason"],
)
BULKHEAD_QUEUE_WAIT = Histogram(
    PREFIX + "bulkhead_queue_wait_seconds",
    "Time a request waited in a bulkhead's queue (only requests that had to wait)",
    ["kind", "name"],
    buckets=_REQUEST_BUCKETS,
)
STORE_LATENCY = Histogram(
    PREFIX + "store_latency_seconds",
    "Durable store statement latency by operation",
    ["operation"],
    buckets=_STORAGE_BUCKETS,
)
STORE_ERRORS = Counter(
    PREFIX + "store_errors_total",
    "Durable store statements that failed (store unavailable)",
    ["operation"],
)
CACHE_LATENCY = Histogram(
    PREFIX + "cache_latency_seconds",
    "Replay cache latency by operation",
    ["operation"],
    buckets=_STORAGE_BUCKETS,
)
CACHE_LOOKUPS = Counter(
    PREFIX + "cache_lookups_total",
    "Replay cache lookups by result: hit, miss, error",
    ["result"],
)
ORPHAN_RELEASES = Counter(
    PREFIX + "orphan_releases_total",
    "Claims that may have committed after the gateway gave up on them, by what became of "
    "them: released, absent (never committed or taken over), dropped (queue full or past "
    "their record's TTL)",
    ["result"],
)
FENCED_WRITES = Counter(
    PREFIX + "fenced_writes_total",
    "Writes by an owner that had been fenced off (they changed nothing)",
    ["write"],
)
TAKEOVERS = Counter(
    PREFIX + "takeovers_total",
    "Records taken over by a new execution, by reason",
    ["reason"],
)
STUCK_RECORDS = Gauge(
    PREFIX + "stuck_records",
    "IN_PROGRESS records whose lease ran out (owner died or stalled), sampled periodically; "
    "capped at the sample limit",
    # Every worker counts the same table: the freshest sample of a live worker is the answer.
    multiprocess_mode="livemostrecent",
)
BUILD_INFO = Gauge(
    PREFIX + "build_info",
    "Always 1; the labels say which gateway and Python versions run",
    ["version", "python_version"],
    # One series per version: during a rolling restart old and new workers both show.
    multiprocess_mode="livemax",
)
EVENT_LOOP_LAG = Histogram(
    PREFIX + "event_loop_lag_seconds",
    "How late a worker's event loop ran a timer due every 0.1 s: time the loop spent on work "
    "that did not yield, or the process did not run",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
SWEPT_RECORDS = Counter(
    PREFIX + "swept_records_total",
    "Expired records deleted by the sweeper",
)


def _package_version() -> str:
    try:
        return importlib.metadata.version("idempotency-gateway")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


BREAKER_STATE_VALUES = {
    "closed": 0,
    "half_open": 1,
    "open": 2,
    "forced_open": 3,
    "forced_closed": 4,
    "disabled": 5,
}


BUILD_INFO.labels(_package_version(), platform.python_version()).set(1)
# Label values known in advance: their series exist (at zero) before the first event, so a
# rate() over them starts from the first scrape instead of the first failure.
for _result in ("hit", "miss", "error"):
    CACHE_LOOKUPS.labels(_result)
for _result in ("released", "absent", "dropped"):
    ORPHAN_RELEASES.labels(_result)

# Every family above, for scrapes that must show them before their first sample.
DECLARED: tuple[MetricWrapperBase, ...] = tuple(
    value for value in list(globals().values()) if isinstance(value, MetricWrapperBase)
)


class EveryFamily(Collector):
    """The workers' merged samples, plus an empty family for each declared metric no worker
    has written yet: a multiprocess scrape otherwise shows a family only from its first
    sample, so alerts and dashboards would see it appear later with N workers than with one."""

    def __init__(self, merged: Collector, declared: Iterable[MetricWrapperBase]) -> None:
        self._merged = merged
        self._declared = tuple(declared)

    def collect(self) -> Iterator[Metric]:
        families = list(self._merged.collect())
        seen = {family.name for family in families}
        yield from families
        for metric in self._declared:
            for family in metric.describe():
                if family.name not in seen:
                    yield family


def exposition() -> tuple[bytes, str]:
    """The scrape body: every worker's samples when running multiprocess."""
    directory = os.environ.get(MULTIPROCESS_ENV)
    if directory:
        registry = CollectorRegistry()
        merged = MultiProcessCollector(None)  # type: ignore[no-untyped-call]
        registry.register(EveryFamily(merged, DECLARED))
        registry.register(WorkerProcessCollector(lambda: live_worker_pids(directory)))
        return generate_latest(registry), CONTENT_TYPE_LATEST
    from prometheus_client import REGISTRY

    return generate_latest(REGISTRY), CONTENT_TYPE_LATEST
